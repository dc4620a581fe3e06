"""Registers, spills and shared memory of the decode kernels, this tree against a git revision (`ptxas -v`).

The split-K merge lives in the decode kernels' SPLIT instantiations, which the host launches only when a
step has P > 1 partitions; a one-partition launch (every large batch) must cost what it did before the merge
existed. This compiles the decode build units of this tree and of --ref (kernels_cuda/decode_hd<D>.cu, one per
head_dim with every dtype; decode_<dtype>.cu before round 11's build split) with jit.py's flags for sm_90 (no GPU
needed, only nvcc) and checks that every one-partition kernel (row kernel, 16-bit and fp8 tensor-core kernels) has
the resources of the kernel of the same name at --ref; the SPLIT ones are listed beside their one-partition twin.

    python benchmarks/decode_registers.py [--ref HEAD] [--dtypes bf16,f16,f32]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-gencode=arch=compute_90,code=sm_90", "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas", "-v"]
KERNEL = re.compile(r"(row_attn_kernel|group_mma_decode_kernel|group_mma_fp8_decode_kernel)<(.*)>"
                    r"\(pagednb::AttnParams\)$")
DTYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float"}  # the kernels' first template argument


def units(src_dir: Path) -> list[Path]:
    """The tree's decode build units: one per head_dim, or (before the split) one per dtype."""
    return sorted(src_dir.glob("decode_hd*.cu")) or [src_dir / f"decode_{d}.cu" for d in DTYPES
                                                     if (src_dir / f"decode_{d}.cu").exists()]


def resources(src_dir: Path) -> dict[str, tuple[int, int, int]]:
    """{demangled kernel: (registers, spill bytes stored + loaded, static smem bytes)} of every decode unit."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        found = {}
        for part in pool.map(unit_resources, units(src_dir)):
            found.update(part)
    return found


def unit_resources(unit: Path) -> dict[str, tuple[int, int, int]]:
    log = subprocess.run(["nvcc", *FLAGS, "-c", str(unit), "-o", "/dev/null"],
                         capture_output=True, text=True, check=True).stderr
    found, name = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name, spills = m.group(1), 0
        elif (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)) and name:
            spills = int(m.group(1)) + int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            smem = re.search(r"(\d+) bytes smem", line)
            found[name] = (int(m.group(1)), spills, int(smem.group(1)) if smem else 0)
            name = None
    names = list(found)
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {d: found[n] for n, d in zip(names, demangled)}


def checkout(ref: str, into: Path) -> Path:
    """kernels_cuda/ as of `ref`, written under `into`."""
    files = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:kernels_cuda"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        blob = subprocess.run(["git", "show", f"{ref}:kernels_cuda/{f}"], cwd=ROOT, capture_output=True, check=True)
        (into / f).write_bytes(blob.stdout)
    return into


def compare(dtype: str, ours: dict, theirs: dict) -> bool:
    same, differ, split, paired = 0, [], [], []
    for name, res in sorted(ours.items()):
        m = KERNEL.search(name)
        if not m:
            continue
        args = m.group(2).split(", ")
        if args[0] != DTYPES[dtype]:
            continue
        if m.group(1) == "row_attn_kernel" and len(args) == 8:  # KVC, kv heads per CTA: 1 is the kernel a ref had
            if args.pop() != "1":
                paired.append(res)
                continue
            name = name.replace(", 1>(", ">(")
        if args[-1] == "true":  # a SPLIT instantiation: beside its one-partition twin
            twin = name.replace(", true>(", ", false>(")
            split.append((name, res, ours.get(twin, ours.get(twin.replace(">(", ", 1>(")))))
            continue
        ref = theirs.get(name.replace(">(", ", 1>("),  # a ref with KVC, then one before KVC, before SPLIT
                         theirs.get(name, theirs.get(name.replace(", false>(", ">("))))
        if ref == res:
            same += 1
        else:
            differ.append((name, res, ref))
    print(f"{dtype}: {same} one-partition kernels as at the ref, {len(differ)} differ")
    for name, res, ref in differ:
        print(f"  DIFFERS {name}: (registers, spill bytes, smem) {res} vs {ref}")
    spilling = [s for s in split if s[1][1]]
    worst = max(split, key=lambda s: s[1][0] - s[2][0]) if split else None
    if worst:
        print(f"  {len(split)} SPLIT kernels, {len(spilling)} spill; most registers over the one-partition twin: "
              f"{worst[1][0]} vs {worst[2][0]} ({worst[0]})")
    if paired:
        print(f"  {len(paired)} kernels of two kv heads per CTA (no twin at the ref), {sum(1 for r in paired if r[1])} "
              f"spill, at most {max(r[0] for r in paired)} registers")
    return not differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="git revision to compare with")
    ap.add_argument("--dtypes", default="bf16,f16,f32")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir = checkout(args.ref, Path(tmp))
        ours, theirs = resources(ROOT / "kernels_cuda"), resources(ref_dir)
        for dtype in args.dtypes.split(","):
            ok &= compare(dtype, ours, theirs)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
