"""Split a safetensors file into pieces of whole tensors, each under a size limit, and join them back.
Safetensors only (no pickles); used on the GPU machine (device.sh, files come back at most 16 MiB each)
and here (collect.sh). Order of use: device.sh runs `split`, collect.sh runs `join`.

  python split.py split IN OUTDIR --max-mib 15 [--prefix adapter] [--dtype bf16]
      -> OUTDIR/adapter-00.safetensors, adapter-01... ; each piece's metadata says its index, the count,
         the source's metadata and a digest of the whole key/shape/dtype list (checked by join)
  python split.py join PIECES_DIR OUT [--prefix adapter] [--dtype fp32]
      -> OUT: every tensor of every piece, after checking that all pieces are there, none twice, and
         that keys, shapes and dtypes match the digest the pieces carry
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def signature(tensors: dict[str, torch.Tensor]) -> str:
    rows = sorted(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in tensors.items())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def split(src: Path, outdir: Path, max_mib: float, prefix: str, dtype: str | None) -> list[Path]:
    with safe_open(str(src), framework="pt") as handle:
        source_meta = handle.metadata() or {}
    tensors = load_file(str(src))
    if dtype:
        tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    limit = int(max_mib * 2**20) - 2**20  # 1 MiB left for the header and metadata
    groups, size = [[]], 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if nbytes > limit:
            raise SystemExit(f"{key}: {nbytes} bytes, larger than a piece may be ({max_mib} MiB)")
        if size + nbytes > limit and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    outdir.mkdir(parents=True, exist_ok=True)
    digest, paths = signature(tensors), []
    for index, keys in enumerate(groups):
        meta = {"piece": str(index), "pieces": str(len(groups)), "tensors": str(len(tensors)),
                "signature": digest, "source_metadata": json.dumps(source_meta), "source_name": src.name}  # fmt: skip
        path = outdir / f"{prefix}-{index:02d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(path), metadata=meta)
        paths.append(path)
    return paths


def join(piece_dir: Path, out: Path, prefix: str, dtype: str | None) -> dict:
    paths = sorted(piece_dir.glob(f"{prefix}-*.safetensors"))
    if not paths:
        raise SystemExit(f"no {prefix}-*.safetensors in {piece_dir}")
    tensors, metas = {}, []
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            metas.append(handle.metadata() or {})
        part = load_file(str(path))
        twice = tensors.keys() & part.keys()
        if twice:
            raise SystemExit(f"{path}: tensors already in another piece: {sorted(twice)[:3]}")
        tensors |= part
    count, digest = metas[0]["pieces"], metas[0]["signature"]
    mixed = any(m.get("pieces") != count or m.get("signature") != digest for m in metas)
    if mixed or int(count) != len(paths) or sorted(int(m["piece"]) for m in metas) != list(range(len(paths))):
        raise SystemExit(
            f"{piece_dir}: pieces {[m.get('piece') for m in metas]} of {count}: incomplete or mixed"
        )
    if len(tensors) != int(metas[0]["tensors"]) or signature(tensors) != digest:
        raise SystemExit(f"{piece_dir}: the joined tensors do not match the pieces' signature")
    if dtype:
        tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=json.loads(metas[0]["source_metadata"]) or None)
    return {"pieces": len(paths), "tensors": len(tensors), "bytes": out.stat().st_size}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split")
    p.add_argument("src", type=Path)
    p.add_argument("outdir", type=Path)
    p.add_argument("--max-mib", type=float, default=15)
    p.add_argument("--prefix", default="piece")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors first (e.g. bf16)")
    p = sub.add_parser("join")
    p.add_argument("piece_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--prefix", default="piece")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating tensors after joining (e.g. fp32)")
    args = parser.parse_args(argv)
    if args.command == "split":
        for path in split(args.src, args.outdir, args.max_mib, args.prefix, args.dtype):
            print(f"{path} {path.stat().st_size / 2**20:.2f} MiB")
    else:
        print(json.dumps(join(args.piece_dir, args.out, args.prefix, args.dtype)))


if __name__ == "__main__":
    sys.exit(main())
