"""Kinds of malformed input (``tests/test_fuzz_cli.py``): plan strings and plan files."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from fuzz_harness import JSON_SCALARS, MFCS, ROLES, WORD, config_argv, kind, quoted
from loomrl.config.schema import TrainConfig

# --- plan strings: runtime.plan=..., train --plan, plan --plan ---------------------------------------------


def _plan_argv(data, files, text: str) -> list[str]:
    """``text`` as runtime.plan, as train --plan, or as plan --plan on the same four CPU devices."""
    channel = data.draw(st.sampled_from(["override", "train-flag", "plan-flag"]), label="channel")
    if channel == "override":
        return config_argv("train", files, [f"runtime.plan={quoted(text)}"])
    if channel == "train-flag":
        return [*config_argv("train", files, []), "--plan", text]
    return ["plan", "--cluster", "cpu:1x4", "--model", "llama-1m", "--plan", text, "--out", files.path("-plan")]


def _placement(**items: str) -> str:
    """A plan string placing every call on all four devices, with ``items`` replacing or adding items."""
    placed = {name: "0-3" for name in MFCS}
    placed.update(items)
    return "; ".join(f"{name}={value}" for name, value in placed.items())


@kind("plan string")
def unknown_strategy(data, files):
    word = data.draw(WORD.filter(lambda w: w.partition(":")[0] not in ("colocate", "interleave", "separate")))
    return _plan_argv(data, files, word), ("plan",)


@kind("plan string")
def separate_with_a_bad_device_count(data, files):
    count = data.draw(
        st.one_of(WORD, st.integers(-99, 0).map(str), st.integers(4, 10**30).map(str), st.just("1.5"), st.just("2x"))
    )  # 'separate:' alone means separate
    return _plan_argv(data, files, f"separate:{count}"), ("separate", "gen_devices", "plan")


@kind("plan string")
def argument_to_a_strategy_without_one(data, files):
    strategy = data.draw(st.sampled_from(["colocate", "interleave"]))
    return _plan_argv(data, files, f"{strategy}:{data.draw(st.integers(0, 9))}"), ("plan",)


@kind("plan string")
def placement_after_a_strategy(data, files):
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:1"]))
    return _plan_argv(data, files, f"{strategy}; {data.draw(st.sampled_from(MFCS))}=0-3"), ("plan item",)


@kind("plan string")
def fusion_item_malformed(data, files):
    value = data.draw(
        st.one_of(
            WORD,
            st.floats(1.0001, 1e9).map(lambda v: f"migrate_at:{v}"),
            st.floats(-1e9, -1e-6).map(lambda v: f"migrate_at:{v}"),
            st.sampled_from(
                [
                    "migrate_at:nan",
                    "migrate_at:inf",
                    "migrate_at:x",
                    "migrate_to:0",
                    "migrate_to:-1",
                    "migrate_to:x",
                    "chunk:-1",
                    "chunk:1.5",
                    "chunk:",
                    "migrate_at",
                    ":",
                    "migrate_to:99",
                ]
            ),
        )
    )
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:2", _placement()]))
    return _plan_argv(data, files, f"{strategy}; stream_fusion={value}"), ("stream_fusion",)


@kind("plan string")
def fuse_train_neither_on_nor_off(data, files):
    value = data.draw(WORD.filter(lambda w: w not in ("on", "off")))
    return _plan_argv(data, files, f"colocate; pipeline_fusion={value}"), ("pipeline_fusion",)


@kind("plan string")
def unknown_model_call(data, files):
    name = data.draw(
        WORD.filter(lambda w: w not in MFCS and w not in ("shadow", "offload", "stream_fusion", "advantages"))
    )
    return _plan_argv(data, files, _placement(**{name: "0-3"})), (name,)


@kind("plan string")
def item_without_name_or_equals(data, files):
    item = data.draw(st.sampled_from(["=0-3", " = 0-3", "=", "=:dp4"]))
    return _plan_argv(data, files, f"{_placement()}; {item}"), ("plan item",)


@kind("plan string")
def device_list_malformed(data, files):
    devices = data.draw(st.sampled_from(["", "a", "0-", "-3", "0--3", "0,,1", "0-3-5", "0.5", "0:3", "x-y", "1e2"]))
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: devices})), (mfc, "plan")


@kind("plan string")
def device_range_reversed(data, files):
    first = data.draw(st.integers(1, 3))
    last = data.draw(st.integers(0, first - 1))
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: f"{first}-{last}"})), (mfc,)


@kind("plan string")
def device_outside_the_cluster(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    high = data.draw(st.integers(4, 10**6))
    devices = data.draw(st.sampled_from([f"0-{4 + high % 1000}", f"{high}", f"0,{high}"]))
    return _plan_argv(data, files, _placement(**{mfc: devices})), (mfc,)


@kind("plan string")
def overlapping_ranges_in_one_mesh(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    a = data.draw(st.integers(0, 3))
    return _plan_argv(data, files, _placement(**{mfc: f"0-3,{a}"})), (mfc,)


@kind("plan string")
def device_range_of_astronomical_size(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    end = data.draw(st.integers(2**20, 10**40))
    return _plan_argv(data, files, _placement(**{mfc: f"0-{end}"})), (mfc,)


def _bad_layout(data, files, layouts: list[str]):
    """One call placed on devices 0-3 with one of ``layouts``; the error must name the call."""
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:{data.draw(st.sampled_from(layouts))}"})), (mfc,)


@kind("plan string")
def layout_with_junk_tokens(data, files):
    return _bad_layout(data, files, ["x", "dp", "tp", "dp4x", "d4", "DP4", "dp-1", "dp4 tp1", "4", "dp4,", "pp"])


@kind("plan string")
def layout_degree_zero(data, files):
    return _bad_layout(data, files, ["dp0", "tp0", "pp0", "mb0", "dp00", "tp1pp0"])


@kind("plan string")
def layout_not_matching_its_mesh(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    dp, tp = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    if dp * tp == 4:
        dp += 1
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:dp{dp}tp{tp}"})), (mfc,)


@kind("plan string")
def layout_token_given_twice(data, files):
    return _bad_layout(data, files, ["dp2dp2", "tp1tp1", "mb2mb2", "rcrc", "zerozero", "pp2revrev"])


@kind("plan string")
def call_placed_twice(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, f"{_placement()}; {mfc}=0-1"), (mfc,)


@kind("plan string")
def call_not_placed(data, files):
    missing = data.draw(st.sets(st.sampled_from(MFCS), min_size=1, max_size=len(MFCS) - 1))
    text = "; ".join(f"{name}=0-3" for name in MFCS if name not in missing)
    return _plan_argv(data, files, text), tuple(missing)


@kind("plan string")
def unknown_role_in_shadow_or_offload(data, files):
    key = data.draw(st.sampled_from(["shadow", "offload"]))
    role = data.draw(WORD.filter(lambda w: w not in ROLES))
    return _plan_argv(data, files, f"colocate; {key}={role}"), (role,)


@kind("plan string")
def incompatible_call_options(data, files):
    mfc, layout = data.draw(
        st.sampled_from(
            [
                ("actor_train", "dp4zerofsdp"),
                ("critic_train", "pp2dp2fsdp"),
                ("actor_gen", "dp4rc"),
                ("ref_inf", "dp4rc"),
                ("actor_gen", "dp2rev"),
                ("critic_inf", "dp1pp4rcrev"),
            ]
        )
    )
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:{layout}"})), (mfc,)


@kind("plan string")
def compute_step_sharded(data, files):
    layout = data.draw(st.sampled_from(["0-3:tp4", "0-3:pp4", "0-3:dp2tp2", "0-1:tp2"]))
    return _plan_argv(data, files, _placement(advantages=layout)), ("advantages",)


@kind("plan string")
def plan_change_to_a_malformed_plan(data, files):
    text = data.draw(
        st.sampled_from(["colocatee", "separate:0", "actor_gen=0-9", "colocate; stream_fusion=x", "interleave:2"])
    )
    iteration = data.draw(st.integers(1, 10**6))
    argv = config_argv("train", files, [f"runtime.plan_changes={{{iteration}: {quoted(text)}}}"])
    return argv, (f"runtime.plan_changes.{iteration}",)


# --- plan files (as `loomrl plan --out` and a run's plan file write them) ---------------------------------


def _plan_file_text(data) -> str:
    """A valid plan file for cpu:1x4, of a strategy drawn, as ExecutionPlan.save writes it."""
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan import make_plan
    from loomrl.plan.cluster import ClusterSpec

    cfg = TrainConfig()
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:1", "separate:2", "separate:3"]))
    plan = make_plan(strategy, build_workflow(cfg.algo, cfg.rollout), ClusterSpec.parse("cpu:1x4"))
    return json.dumps(plan.to_dict(), indent=2) + "\n"


def _plan_file_kind(mutate):
    """A plan-file kind: ``mutate(data, plan_dict)`` → the file's content (str or bytes) or a mutated dict."""

    def make(data, files):
        text = _plan_file_text(data)
        content = mutate(data, json.loads(text)) if mutate.__code__.co_argcount == 2 else mutate(data, text, None)
        if isinstance(content, dict):
            content = json.dumps(content)
        path = files.write(".json", content)
        return _plan_argv(data, files, path), (path, "plan.")

    make.__name__ = mutate.__name__
    return make


@kind("plan file")
@_plan_file_kind
def truncated(data, text, _):
    return text[: data.draw(st.integers(0, len(text) - 3))]


@kind("plan file")
@_plan_file_kind
def not_json_at_all(data, text, _):
    return data.draw(st.one_of(st.binary(max_size=40).map(lambda b: b + b"\xff"), WORD, st.just("colocate")))


@kind("plan file")
@_plan_file_kind
def top_level_not_an_object(data, text, _):
    return json.dumps(data.draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3))))


@kind("plan file")
@_plan_file_kind
def key_given_twice(data, text, _):
    key = data.draw(st.sampled_from(["cluster", "allocations", "shadow"]))
    return text.rstrip().rstrip("}") + f', "{key}": null}}'


@kind("plan file")
@_plan_file_kind
def plan_nested_too_deeply(data, text, _):
    depth = data.draw(st.integers(2000, 100_000))
    return '{"cluster": ' + "[" * depth + "]" * depth + "}" if data.draw(st.booleans()) else "[" * depth + "]" * depth


@kind("plan file")
@_plan_file_kind
def nan_or_infinity_in_a_number(data, text, _):
    value = data.draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
    return text.replace('"memory_gb": 24.0', f'"memory_gb": {value}')


@kind("plan file")
@_plan_file_kind
def field_of_the_wrong_type(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    alloc = plan["allocations"][name]
    target, key = data.draw(
        st.sampled_from(
            [
                (plan["cluster"], "nodes"),
                (plan["cluster"], "devices_per_node"),
                (plan["cluster"], "memory_gb"),
                (plan["cluster"], "profile"),
                (alloc, "devices"),
                (alloc, "dp"),
                (alloc, "tp"),
                (alloc, "pp"),
                (alloc, "micro_batches"),
                (plan, "shadow"),
                (plan, "offload"),
                (plan, "stream_fusion"),
                (plan, "allocations"),
                (plan, "cluster"),
            ]
        )
    )
    wrong = {
        "nodes": ["x", 1.5, True, [1]],
        "devices_per_node": ["4", 4.0, False, None],
        "memory_gb": ["lots", True, [1], {}],
        "profile": [1, None, ["local"]],
        "devices": [1.5, True, {"a": 1}, None, ["0"], [0.5]],
        "dp": ["2", 2.0, True, [2], None],
        "tp": ["1", 1.0, None],
        "pp": ["1", False, {}],
        "micro_batches": ["1", 1.5, []],
        "shadow": ["actor", 1, {"a": 1}, [1]],
        "offload": ["ref", 2, [None]],
        "stream_fusion": ["on", 1, [1]],
        "allocations": [[], "x", 1, None],
        "cluster": ["cpu:4", 4, [], None],
    }[key]
    target[key] = data.draw(st.sampled_from(wrong))
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_key(data, plan):
    where = data.draw(st.sampled_from(["top", "cluster", "allocation", "stream_fusion"]))
    key = data.draw(WORD)
    if where == "top":
        plan[key] = 1
    elif where == "cluster":
        plan["cluster"][key] = 1
    elif where == "stream_fusion":
        plan["stream_fusion"] = {key: 1}
    else:
        plan["allocations"][data.draw(st.sampled_from(sorted(plan["allocations"])))][key] = 1
    return plan


@kind("plan file")
@_plan_file_kind
def required_field_missing(data, plan):
    where = data.draw(st.sampled_from(["cluster", "allocations", "nodes", "devices_per_node", "devices"]))
    if where in ("cluster", "allocations"):
        del plan[where]
    elif where == "devices":
        del plan["allocations"][data.draw(st.sampled_from(sorted(plan["allocations"])))]["devices"]
    else:
        del plan["cluster"][where]
    return plan


@kind("plan file")
@_plan_file_kind
def device_index_out_of_range(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    bad = data.draw(st.one_of(st.integers(4, 10**30), st.integers(-(10**6), -1)))
    alloc = plan["allocations"][name]
    alloc["devices"] = [bad] if data.draw(st.booleans()) else (str(bad) if bad >= 0 else [bad])
    alloc.update(dp=1, tp=1, pp=1)
    return plan


@kind("plan file")
@_plan_file_kind
def overlapping_devices_in_one_mesh(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    d = data.draw(st.integers(0, 3))
    plan["allocations"][name]["devices"] = data.draw(st.sampled_from([[d, d], f"{d},{d}", f"0-3,{d}"]))
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_model_call_name(data, plan):
    names = sorted(plan["allocations"])
    old = data.draw(st.sampled_from(names))
    new = data.draw(WORD.filter(lambda w: w not in names))
    plan["allocations"][new] = plan["allocations"].pop(old) if data.draw(st.booleans()) else plan["allocations"][old]
    return plan


@kind("plan file")
@_plan_file_kind
def model_call_missing(data, plan):
    names = sorted(plan["allocations"])
    for name in data.draw(st.sets(st.sampled_from(names), min_size=1, max_size=len(names) - 1)):
        del plan["allocations"][name]
    return plan


@kind("plan file")
@_plan_file_kind
def degrees_not_matching_the_mesh(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    alloc = plan["allocations"][name]
    key = data.draw(st.sampled_from(["dp", "tp", "pp"]))
    alloc[key] = (
        alloc[key] + data.draw(st.integers(1, 64)) if data.draw(st.booleans()) else data.draw(st.integers(-64, 0))
    )
    return plan


@kind("plan file")
@_plan_file_kind
def cluster_not_the_runs(data, plan):
    key, value = data.draw(
        st.sampled_from(
            [
                ("devices_per_node", 8),
                ("nodes", 2),
                ("memory_gb", 80.0),
                ("profile", "h100-80g"),
                ("device_kind", "h100"),
                ("memory_gb", -1.0),
                ("profile", "tpu-v9"),
                ("device_kind", ""),
            ]
        )
    )
    plan["cluster"][key] = value
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_role_or_bad_fusion(data, plan):
    key = data.draw(st.sampled_from(["shadow", "offload", "stream_fusion"]))
    if key == "stream_fusion":
        plan["stream_fusion"] = data.draw(
            st.sampled_from(
                [{"migrate_at": 2.0}, {"migrate_at": "soon"}, {"migrate_to": 0}, {"chunk": -1}, {"migrate_to": 99}]
            )
        )
    else:
        plan[key] = [data.draw(WORD.filter(lambda w: w not in ROLES))]
    return plan


@kind("plan file")
def plan_file_missing_or_of_an_unknown_suffix(data, files):
    path = data.draw(
        st.sampled_from(
            [
                files.path(".json"),
                files.path(".yaml"),
                files.write(".txt", "{}"),
                files.write(".jsn", "{}"),
                str(files.root) + "/",
            ]
        )
    )
    return _plan_argv(data, files, path), (path.rstrip("/"), "plan")


@kind("plan file")
def yaml_plan_file_broken(data, files):
    content = data.draw(
        st.sampled_from(
            [
                "cluster: {nodes: 1\n",
                "- 1\n",
                "cluster: &a [*a]\n",
                "\x00",
                "",
                "allocations: {actor_gen: {devices: '0-3'}}\n",
            ]
        )
    )
    path = files.write(data.draw(st.sampled_from([".yaml", ".yml"])), content)
    return _plan_argv(data, files, path), (path, "plan.")
