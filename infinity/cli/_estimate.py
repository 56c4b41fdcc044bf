"""``infinity estimate``: the memory ledger per ZeRO stage and tier, from a parameter count or a model.

Examples::

    infinity estimate --params 7.5e9 --gpus 64                 # the ZeRO paper's Figure 1
    infinity estimate --model llama-7b/config.json --gpus 4 --offload-optimizer cpu --json
    infinity estimate --params 7e9 --gpus 4 --config ds_config.json
    infinity estimate --model llama-7b/config.json --micro-batch 8 --checkpointing --offload-activations

``--model`` reads a Hugging Face ``config.json`` (``model_type`` llama, mistral, qwen2, qwen3 or
gpt2) or a small native JSON (``num_layers``, ``hidden_size``, ``num_heads``, ``vocab_size``,
``seq_len``, optional ``kind``/``intermediate_size``/``num_kv_heads``...).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Mapping

from infinity._common import format_bytes, read_json_object
from infinity.config import InfinityConfig, load_config
from infinity.ledger import (GB, OPTIMIZERS, ModelShape, StateTerms, activation_bytes,
                             estimate_model_states)

_LLAMA_FAMILY = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}
_NATIVE_KEYS = set(ModelShape.__dataclass_fields__)


def shape_from_hf_config(raw: Mapping[str, Any], *, seq_len: int | None = None) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict (llama family or gpt2)."""
    model_type = raw.get("model_type")
    # [Note: fused attention keeps no scores] in infinity/ledger/_activations.py: SDPA unless
    # the file asks for eager attention.
    eager = "eager" in (raw.get("attn_implementation"), raw.get("_attn_implementation"))
    if model_type == "gpt2":
        h = raw["n_embd"]
        positions = raw.get("n_positions", raw.get("n_ctx", 1024))
        return ModelShape(kind="gpt2", num_layers=raw["n_layer"], hidden_size=h,
                          num_heads=raw["n_head"], vocab_size=raw["vocab_size"],
                          intermediate_size=raw.get("n_inner") or 4 * h,
                          max_position_embeddings=positions, seq_len=seq_len or positions,
                          tie_word_embeddings=raw.get("tie_word_embeddings", True),
                          eager_attention=eager)
    if model_type in _LLAMA_FAMILY:
        extra = dict(_LLAMA_FAMILY[model_type])
        if "attention_bias" in raw:
            extra["attention_bias"] = bool(raw["attention_bias"])
        positions = raw.get("max_position_embeddings", 2048)
        try:
            return ModelShape(kind="llama", num_layers=raw["num_hidden_layers"],
                              hidden_size=raw["hidden_size"], num_heads=raw["num_attention_heads"],
                              num_kv_heads=raw.get("num_key_value_heads"),
                              head_dim=raw.get("head_dim"), vocab_size=raw["vocab_size"],
                              intermediate_size=raw["intermediate_size"],
                              max_position_embeddings=positions, seq_len=seq_len or positions,
                              tie_word_embeddings=raw.get("tie_word_embeddings", False),
                              mlp_bias=bool(raw.get("mlp_bias", False)),
                              eager_attention=eager, **extra)
        except KeyError as e:
            raise ValueError(f"Hugging Face config ({model_type}): missing key {e.args[0]!r}") from None
    known = ", ".join(["gpt2", *_LLAMA_FAMILY])
    raise ValueError(f"Hugging Face config: model_type {model_type!r} is not one whose parameters we "
                     f"count exactly (known: {known}); pass --params N instead")


def shape_from_dict(raw: Mapping[str, Any], *, seq_len: int | None = None) -> ModelShape:
    """A native shape dict (``ModelShape``'s field names) or a Hugging Face config dict."""
    if "model_type" in raw:
        return shape_from_hf_config(raw, seq_len=seq_len)
    unknown = sorted(set(raw) - _NATIVE_KEYS)
    if unknown:
        raise ValueError(f"model shape: unknown key(s) {unknown}; known: {sorted(_NATIVE_KEYS)} "
                         "(or a Hugging Face config.json with model_type)")
    kwargs = dict(raw)
    if seq_len:
        kwargs["seq_len"] = seq_len
    if "num_heads" not in kwargs and "hidden_size" in kwargs:
        kwargs["num_heads"] = max(1, kwargs["hidden_size"] // 128)
    try:
        return ModelShape(**kwargs)
    except TypeError as e:
        raise ValueError(f"model shape: {e}; required: num_layers, hidden_size, vocab_size") from None


def load_model_shape(path: str, *, seq_len: int | None = None) -> ModelShape:
    return shape_from_dict(read_json_object(path, "--model"), seq_len=seq_len)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared with ``infinity plan``: what model, how many ranks."""
    parser.add_argument("--params", type=float, help="parameter count (e.g. 7.5e9)")
    parser.add_argument("--model", metavar="CONFIG",
                        help="model shape: Hugging Face config.json or native shape JSON")
    parser.add_argument("--seq-len", type=int, help="training sequence length (default: the model's)")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel degree N (total ranks)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="ranks per node (host RAM and NVMe are per node); default min(N, 8)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                        help="optimizer whose state K counts (adam: 2 moments, sgd-momentum: 1, sgd: 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="one stage (default: all)")
    parser.add_argument("--param-bytes", type=float, help="bytes per parameter copy (default 2)")
    parser.add_argument("--grad-bytes", type=float, help="bytes per gradient (default 2)")
    parser.add_argument("--optimizer-bytes", type=float,
                        help="K, optimizer bytes per parameter (default 12: mixed-precision Adam)")
    parser.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none",
                        help="stage 3's parameter shards (other stages keep parameters on the device)")
    parser.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none")
    parser.add_argument("--config", help="engine config (native or DeepSpeed JSON): terms, stage, "
                                         "offload tiers and sub-group size come from it")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank (activations)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="full activation checkpointing (also on when --config sets "
                             "activation_checkpointing.units)")
    parser.add_argument("--offload-activations", nargs="?", const="host", default=None,
                        choices=("host", "nvme"),
                        help="checkpointed layer inputs in host memory (bare flag, or 'host') or "
                             "on NVMe ('nvme'): activation_checkpointing.offload; needs "
                             "checkpointing")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def resolve_model(args: argparse.Namespace) -> tuple[int, ModelShape | None]:
    """(parameter count, shape or None) from --params / --model."""
    shape = load_model_shape(args.model, seq_len=args.seq_len) if args.model else None
    if args.params is None and shape is None:
        raise ValueError("give the model: --params N (e.g. 7e9) or --model CONFIG.json")
    if args.params is not None and args.params <= 0:
        raise ValueError(f"--params: expected a positive count, got {args.params!r}")
    numel = int(args.params) if args.params is not None else shape.num_params()
    return numel, shape


def gpus_per_node(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise ValueError(f"--gpus: expected >= 1, got {args.gpus}")
    n = args.gpus_per_node or min(args.gpus, 8)
    if n < 1:
        raise ValueError(f"--gpus-per-node: expected >= 1, got {n}")
    return min(n, args.gpus)


def _terms_from_args(args: argparse.Namespace, config: InfinityConfig | None) -> StateTerms:
    if config is not None:
        base = StateTerms.from_config(config, optimizer=args.optimizer)
    elif args.optimizer != "adam":
        base = StateTerms.for_training(dtype="bf16", optimizer=args.optimizer)
    else:
        base = StateTerms()
    return StateTerms(
        param_bytes=base.param_bytes if args.param_bytes is None else args.param_bytes,
        grad_bytes=base.grad_bytes if args.grad_bytes is None else args.grad_bytes,
        optimizer_bytes=base.optimizer_bytes if args.optimizer_bytes is None else args.optimizer_bytes)


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``infinity estimate`` prints, as a dict (the ``--json`` form)."""
    numel, shape = resolve_model(args)
    config = load_config(args.config) if args.config else None
    terms = _terms_from_args(args, config)
    per_node = gpus_per_node(args)
    offload_param, offload_optimizer = args.offload_param, args.offload_optimizer
    sub_group = None
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    if config is not None:
        if args.stage is None:
            stages = [config.zero.stage]
        offload_param, offload_optimizer = config.offload_param.device, config.offload_optimizer.device
        if isinstance(config.zero.sub_group_numel, int):
            sub_group = config.zero.sub_group_numel
    unit = shape.largest_unit_numel() if shape is not None else None
    out: dict[str, Any] = {"numel": numel, "world_size": args.gpus, "gpus_per_node": per_node,
                           "optimizer": args.optimizer, "terms": terms.to_dict(), "stages": {},
                           "notes": []}
    for stage in stages:
        op = offload_param if stage == 3 else "none"
        ledger = estimate_model_states(numel, stage, args.gpus, terms, offload_param=op,
                                       offload_optimizer=offload_optimizer, gpus_per_node=per_node,
                                       sub_group_numel=sub_group, unit_numel=unit)
        out["stages"][str(stage)] = ledger.to_dict()
    if offload_param != "none" and stages != [3]:
        out["notes"].append("offload_param applies to stage 3 only; stages 0-2 keep parameters on "
                            "the device")
    checkpointing, offload_acts = _activation_options(args, config)
    if shape is not None:
        dtype_bytes = int(terms.param_bytes) if terms.param_bytes in (2, 4) else 2
        acts = activation_bytes(shape, micro_batch=args.micro_batch, checkpointing=checkpointing,
                                offload=offload_acts, dtype_bytes=dtype_bytes)
        out["model"] = shape.to_dict()
        out["activations"] = {**acts.to_dict(), "micro_batch": args.micro_batch,
                              "seq_len": shape.seq_len}
        for row in out["stages"].values():  # the tier split with activations on top of the states
            for tier, t in row["tiers"].items():
                t["activations_bytes"] = acts.tier_bytes(tier)
                t["total_with_activations_bytes"] = t["total_bytes"] + acts.tier_bytes(tier)
    elif offload_acts != "none" or checkpointing:
        out["notes"].append("activations need the model's shape: pass --model CONFIG.json")
    return out


def _activation_options(args: argparse.Namespace, config: InfinityConfig | None) -> tuple[bool, str]:
    """(checkpointing, where the kept inputs live: 'none', 'host', 'nvme') from the flags, or the
    config's activation_checkpointing (its 'auto' counted as 'host', its first choice)."""
    checkpointing = bool(args.checkpointing)
    offload = getattr(args, "offload_activations", None) or "none"
    if config is not None:
        checkpointing = checkpointing or config.activation_checkpointing.enabled
        if offload == "none":
            offload = {"auto": "host"}.get(config.activation_checkpointing.offload_tier,
                                           config.activation_checkpointing.offload_tier)
    if offload != "none" and not checkpointing:
        raise ValueError("--offload-activations needs checkpointing: add --checkpointing (or set "
                         "activation_checkpointing.units in the --config file)")
    return checkpointing, offload


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.2f}"


def format_table(report: Mapping[str, Any]) -> str:
    """The human form: one row per stage, terms then tiers, in GB (10^9 B, the papers' unit)."""
    lines = [f"model states per rank: {report['numel']:,} params, N = {report['world_size']} "
             f"({report['gpus_per_node']} per node), optimizer {report['optimizer']}, "
             f"bytes/param p={report['terms']['param_bytes']:g} g={report['terms']['grad_bytes']:g} "
             f"K={report['terms']['optimizer_bytes']:g}  [GB = 1e9 B]"]
    head = f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10} | " \
           f"{'device':>10} {'host':>10} {'host/node':>10} {'nvme/node':>10}"
    lines += [head, "-" * len(head)]
    for stage, row in report["stages"].items():
        tiers = row["tiers"]
        lines.append(
            f"{stage:>5} {_gb(row['params_bytes']):>10} {_gb(row['grads_bytes']):>10} "
            f"{_gb(row['optimizer_bytes']):>10} {_gb(row['total_bytes']):>10} | "
            f"{_gb(tiers['device']['total_bytes']):>10} {_gb(tiers['host']['total_bytes']):>10} "
            f"{_gb(tiers['host']['node_total_bytes']):>10} {_gb(tiers['nvme']['node_total_bytes']):>10}")
    buffers = {f"stage {s} {tier}.{name}": n for s, row in report["stages"].items()
               for tier, t in row["tiers"].items() for name, n in t["buffers"].items()}
    if buffers:
        lines.append("buffers included in the tier columns: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in buffers.items()))
    if "activations" in report:
        a = report["activations"]
        ckpt = ({"host": "on, inputs offloaded to host", "nvme": "on, inputs offloaded to NVMe"}
                .get(a["offload"], "on")) if a["checkpointing"] else "off"
        lines.append(f"activations per rank (micro-batch {a['micro_batch']}, seq {a['seq_len']}, "
                     f"checkpointing {ckpt}): "
                     f"{_gb(a['total_bytes'])} GB (per layer {format_bytes(a['per_layer_bytes'])}, "
                     f"kept {format_bytes(a['stored_bytes'])}, head {format_bytes(a['head_bytes'])})"
                     f": device {_gb(a['device_bytes'])} GB, host {_gb(a['host_bytes'])} GB, "
                     f"nvme {_gb(a['nvme_bytes'])} GB; not included above")
        for stage, row in report["stages"].items():
            tiers = row["tiers"]
            lines.append(f"stage {stage} with activations, per rank: device "
                         f"{_gb(tiers['device']['total_with_activations_bytes'])} GB, host "
                         f"{_gb(tiers['host']['total_with_activations_bytes'])} GB, nvme "
                         f"{_gb(tiers['nvme']['total_with_activations_bytes'])} GB")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


__all__ = ["add_arguments", "add_model_arguments", "build_report", "format_table", "load_model_shape",
           "run", "shape_from_dict", "shape_from_hf_config"]
