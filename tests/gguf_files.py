"""A tiny random Llama written as a GGUF file with the ``gguf`` package's writer, shaped like SmolLM2-135M-Instruct's
file (byte-level BPE tokenizer, ``<|im_start|>`` as bos, ``<|im_end|>`` as eos, a ChatML template, tied
embeddings), for tests of the GGUF import that need no 98 MB download."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Token ids 0, 1, 2: unknown/end of text, bos, eos (as in SmolLM2)."""

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one printable character per byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Write the file and return its path."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "Ġ a", "i s"]
    tokens = [*SPECIAL, *_byte_tokens(), *(m.replace(" ", "") for m in merges)]
    types = [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL))
    vocab = len(tokens)
    head_dim = HIDDEN // HEADS

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    # numpy shapes are [out, in]; the file stores them reversed, as llama.cpp does
    writer.add_tensor("token_embd.weight", weight(vocab, HIDDEN))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1.0 + weight(HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(HIDDEN, HEADS * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1.0 + weight(HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(FFN, HIDDEN))
        # one quantized tensor, so the import dequantizes as it does for the real Q4_1 file
        down = gguf.quants.quantize(weight(HIDDEN, FFN), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", down, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", 1.0 + weight(HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
