"""Test-wide settings: nothing may reach the network, and torch uses one thread per process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread per test process: CI has two cores, and multi-process tests run several processes at once.
torch.set_num_threads(1)

import pytest  # noqa: E402

from loomrl.runtime.launch import LOCAL_SYSTEM_CONFIG  # noqa: E402

SLOW = {
    "tests/test_controllers.py::test_parallel_controllers_compute_the_reference_run[grpo-4dev-4]",  # grpo-2dev-2 stays
    # 4 devices under 2 controllers stay in grpo-separate4-2, ppo in ppo-2dev-2:
    "tests/test_controllers.py::test_parallel_controllers_compute_the_reference_run[ppo-4dev-4]",
    # the pipelines stay:
    "tests/test_controllers.py::test_parallel_controllers_compute_the_reference_run[ppo-fused-train4-2]",
    "tests/test_runtime.py::test_plans_match_the_reference[fused_train4]",  # fused_train2 stays
    # 2procs-equal stays:
    "tests/test_fused_training.py::test_fused_step_equals_separate_pipelines_and_reference[4procs-equal]",
    "tests/test_fused_training.py::test_fused_step_equals_separate_pipelines_and_reference[4procs-critic-pp2x2]",
    # The slowest end-to-end cases, each a variant of one the default suite keeps: `make test` leaves them out to
    # stay within its time, `make test-all` runs everything (README).
    "tests/test_runtime.py::test_bf16_plans_match_the_bf16_reference[fsdp_tp4]",  # fp32 fsdp_tp4 stays
    "tests/test_runtime.py::test_bf16_plans_match_the_bf16_reference[pipeline_tp4]",  # fp32 pipeline_tp4 stays
    "tests/test_runtime.py::test_a_bf16_fsdp_run_resumes_exactly",  # bf16 checkpoints across layouts stay
    "tests/test_runtime.py::test_ranks_without_rows_match_the_reference[fsdp4]",  # dp4 stays
    "tests/test_runtime.py::test_sharded_runs_load_and_save_layout_independent_checkpoints[fsdp_tp4]",  # fsdp2 stays
    "tests/test_runtime.py::test_plans_match_the_reference[pipeline_dp4]",  # pipeline2 and pipeline_tp4 stay
    "tests/test_runtime.py::test_bf16_checkpoints_keep_the_master_weights_across_layouts[zero4]",  # fsdp2 stays
    # fused runs that migrate stay in grpo-colocate-2 and ppo-colocate-2, fused separate ones in ppo-separate:1-2
    # and grpo-separate:1-2:
    "tests/test_fusion.py::test_a_fused_run_is_the_reference_run[grpo-colocate-4]",
    "tests/test_fusion.py::test_a_fused_run_is_the_reference_run[ppo-colocate-4]",
    "tests/test_fusion.py::test_a_fused_run_is_the_reference_run[ppo-separate:2-4]",
    "tests/test_fusion.py::test_a_fused_run_is_the_reference_run[grpo-separate:2-4]",
    # the 2-device twins stay; test_runtime runs colocate4, interleave4 and separate4 against the reference:
    "tests/test_schedule_execution.py::test_the_runtime_executes_the_schedule_the_simulator_priced[colocate-4]",
    "tests/test_schedule_execution.py::test_the_runtime_executes_the_schedule_the_simulator_priced[interleave-4]",
    "tests/test_schedule_execution.py::test_the_runtime_executes_the_schedule_the_simulator_priced[separate-4]",
    "tests/test_plan_change.py::test_a_run_whose_plan_changes_is_the_reference_run[4]",  # [2] stays
    "tests/test_runtime.py::test_plans_match_the_reference[pipeline_tp4]",  # actor_critic_pp2tp2 stays
    "tests/test_runtime.py::test_sharded_runs_load_and_save_layout_independent_checkpoints[zero4]",  # fsdp2 stays
    "tests/test_runtime.py::test_plans_match_the_reference[separate4_fsdp]",  # fsdp2 and separate4 stay
    # from-checkpoint and dynamic-placement stay:
    "tests/test_recovery.py::test_a_lost_worker_is_replaced_and_the_run_is_the_reference_run[from-start]",
    "tests/test_dynamic_sampling.py::test_the_ray_runtime_samples_as_the_reference_does[fused]",  # [copy] stays
    # ppo-2dev-2 and grpo-separate4-2 stay:
    "tests/test_controllers.py::test_parallel_controllers_compute_the_reference_run[ppo-pipelines4-2]",
    # vLLM on Ray with a shadow stays in the asynchronous separate run; bf16 parity's threshold is the processor's:
    "tests/test_vllm_backend.py::test_the_ray_runtime_with_vllm_is_the_reference_run_with_vllm[separate-1+1]",
    "tests/test_vllm_backend.py::test_vllm_logprobs_match_the_trainers_in_bf16",
    # a checkpoint with paused samples resuming on Ray stays with one controller ([ray]):
    "tests/test_async.py::test_a_checkpoint_with_paused_samples_resumes_to_the_same_run[ray_two_controllers]",
}


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance for a module's runtime tests (one per module: a module's runs share it)."""
    import ray

    # address="local": a private instance, never a cluster that Ray's file of the last `ray start` names
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}},
        _system_config=LOCAL_SYSTEM_CONFIG,  # workers at the tests' own priority, as the trainer starts them
    )
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
