"""Tiny GGUF models for the tests, written from a Hugging Face Llama, Mixtral, Qwen2, Qwen3,
Qwen3-MoE or Gemma 3 directory with ``gguf.GGUFWriter`` the way llama.cpp's converter
(``convert_hf_to_gguf.py``) lays them out: ``llama.*`` (``qwen2.*``, ``qwen3.*``,
``qwen3moe.*``, ``gemma3.*``) metadata, ``blk.N.*`` names, the Q and K rows permuted for
llama.cpp's RoPE (Llama and Mixtral only: the others' RoPE is rotate-half there too), experts
stacked in 3-D tensors, Gemma's RMSNorm weights stored as 1 + w, vectors (and biases) in F32
and matrices in the asked type.

This module is written independently of ``mdiedge.model.gguf`` (its own name table and
permutation), so that a test that reads what it writes checks the reader against the
converter's layout rather than against itself.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import numpy as np

PathLike = Union[str, Path]
QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")  # what gguf.quants writes

# Hugging Face name (``model.layers.N.`` stripped) -> GGUF name (``blk.N.`` stripped)
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_GEMMA3_BLOCK = dict(_BLOCK, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
})
ARCHITECTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                 "gemma3_text": "gemma3"}  # config.json model_type -> GGUF (else llama)
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_EXPERTS = {"block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps.weight",
            "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps.weight",
            "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps.weight",
            "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
            "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
            "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: Hugging Face's rotate-half rows -> interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_tensors(hf_dir: Path) -> Dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: Dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update({k: v.astype(np.float32) for k, v in load_file(str(file)).items()})
    return out


def gguf_tensors(hf_dir: Path, config: Dict[str, Any]) -> Iterator[Tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every tensor of the model, in the converter's layout."""
    tensors = _hf_tensors(hf_dir)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    permuted = config["model_type"] not in ARCHITECTURES
    gemma = config["model_type"] == "gemma3_text"
    if gemma:
        tensors = {k: v + 1 if k.endswith("norm.weight") else v for k, v in tensors.items()}
    for name, gname in _GLOBAL.items():
        if name in tensors:
            yield gname, tensors[name]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for name, gname in (_GEMMA3_BLOCK if gemma else _BLOCK).items():
            if prefix + name in tensors:
                w = tensors[prefix + name]
                if name == "self_attn.q_proj.weight" and permuted:
                    w = permute(w, heads)
                elif name == "self_attn.k_proj.weight" and permuted:
                    w = permute(w, kv_heads or heads)
                yield f"blk.{i}.{gname}", w
        for name, gname in _EXPERTS.items():
            experts = [tensors[prefix + name.format(e=e)] for e in range(_experts(config))
                       if prefix + name.format(e=e) in tensors]
            if experts:
                yield f"blk.{i}.{gname}", np.stack(experts)


def _experts(config: Dict[str, Any]) -> int:
    return config.get("num_local_experts") or config.get("num_experts") or 0


def _add_metadata(writer: Any, config: Dict[str, Any], qtype: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    writer.add_name(config.get("_name_or_path") or "tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    params = config.get("rope_parameters") or {}
    rope = params.get("full_attention", params).get("rope_theta") or config.get("rope_theta")
    writer.add_rope_freq_base(float(rope or 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    if config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("sliding_window") and config["model_type"] == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
    if _experts(config):
        writer.add_expert_count(_experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                          "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])


def _with_sentencepiece() -> None:
    """gguf's ``vocab`` module with the SentencePiece library: mdiedge imports gguf with it
    blocked (``model.gguf._gguf_package``), and a module imported so keeps None for it."""
    import gguf.vocab
    from sentencepiece import SentencePieceProcessor

    if gguf.vocab.SentencePieceProcessor is None:
        gguf.vocab.SentencePieceProcessor = SentencePieceProcessor


def _add_vocab(writer: Any, config: Dict[str, Any], tokenizer: Optional[PathLike]) -> None:
    """The vocabulary as the converter writes it: from ``tokenizer`` (a folder holding a
    tokenizer.json: ``gpt2`` BPE with merges; a tokenizer.model: ``llama`` SentencePiece), or
    placeholder tokens when it is None."""
    from gguf.vocab import BpeVocab, SentencePieceVocab, SpecialVocab

    if tokenizer is None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"<t{i}>" for i in range(config["vocab_size"])])
        writer.add_bos_token_id(config.get("bos_token_id", 1))
        writer.add_eos_token_id(config.get("eos_token_id", 2))
        return
    folder = Path(tokenizer)
    folder = folder if folder.is_dir() else folder.parent
    if (folder / "tokenizer.model").is_file():
        _with_sentencepiece()
        vocab: Any = SentencePieceVocab(folder)
        writer.add_tokenizer_model("llama")
    else:
        vocab = BpeVocab(folder)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types([int(t) for t in types])
    special = SpecialVocab(folder, load_merges=vocab.tokenizer_model == "gpt2",
                           n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)


def write_gguf(path: PathLike, hf_dir: PathLike, qtype: str = "F32",
               tokenizer: Optional[PathLike] = None) -> Path:
    """Write the Hugging Face model in ``hf_dir`` as the GGUF file ``path``: matrices in
    ``qtype`` (one of ``QTYPES``; a matrix whose rows are not whole blocks falls back to F16,
    as the converter does), vectors in F32. ``tokenizer``: see ``_add_vocab``."""
    import gguf

    path, hf_dir = Path(path), Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, ARCHITECTURES.get(config["model_type"], "llama"))
    _add_metadata(writer, config, qtype)
    _add_vocab(writer, config, tokenizer)
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    for name, w in gguf_tensors(hf_dir, config):
        if w.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, w.astype(np.float32))
        elif qtype == "F16" or w.shape[-1] % block:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
