"""``infinity consolidate DIR OUT [--dtype fp32|bf16] [--max-shard-bytes 5GB]``: the command over
:func:`infinity.checkpoint.consolidate` (see there for what is written and the memory bound)."""

from __future__ import annotations

import argparse
import re

from infinity.checkpoint import DEFAULT_MAX_SHARD_BYTES, OUT_DTYPES, consolidate


def parse_bytes(text: str) -> int:
    """'5GB' (10**9), '512MiB' (2**20), '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 5GB, 512MiB, 1000)")
    unit = (m.group(2) or "").lower()
    base = 1024 if unit.endswith("i") else 1000
    power = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[:1]]
    return int(float(m.group(1)) * base ** power)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="DIR",
                        help="checkpoint root (its 'latest' save is used) or one step-* save")
    parser.add_argument("out", metavar="OUT", help="output directory for the safetensors files")
    parser.add_argument("--dtype", choices=sorted(OUT_DTYPES), default="fp32",
                        help="floating-point dtype of the output (default fp32, from the masters)")
    parser.add_argument("--max-shard-bytes", type=parse_bytes, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest output file before a new one starts (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace model*.safetensors and the index already in OUT")


def run(args: argparse.Namespace) -> int:
    result = consolidate(args.checkpoint, args.out, dtype=args.dtype,
                         max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite)
    where = result.index_path or result.files[0]
    print(f"wrote {result.num_tensors} tensors, {result.total_bytes} bytes, in "
          f"{len(result.files)} file(s): {where} (peak held {result.peak_held_bytes} bytes)")
    return 0

