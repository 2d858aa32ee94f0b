"""Static cost of the 4-bit update kernel (snaketune.train.adam4bit) without a GPU: Triton compiles it for a CUDA
target (ptxas ships in Triton's wheel), cuobjdump counts its SASS instructions (the loops are unrolled: close to what
each program runs) and the registers per thread (what bounds the occupancy), for each rounding of the states and
each way of finding v's code; with --ref FILE also a kernel from another revision (`git show REV:PATH > FILE`).
Not a timing: bench/kernels/adam4bit_speed.py times the kernel on a GPU.

    python -m bench adam4bit_sass [--arch 90] [--ref /tmp/adam4bit_old.py ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from snaketune.train import adam4bit

SIGNATURE = {
    "p_ptr": "*bf16", "g_ptr": "*bf16", "m_codes": "*u8", "m_scale": "*fp32", "v_codes": "*u8", "v_scale": "*fp32",
    "m_qmap": "*fp32", "v_qmap": "*fp32", "v_table": "*fp32", "partial_ptr": "*fp32", "divisor_ptr": "*fp32",
    "n_blocks": "i32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "decay": "fp32",
    "step_size": "fp32", "bc2_sqrt": "fp32", "seed": "i32",
}  # fmt: skip
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def cost(fn, constants: dict, arch: int, warps: int) -> tuple[int, str]:
    """(SASS instructions, registers per thread) of the kernel `fn` with these constexprs, bf16 weights."""
    names = fn.arg_names
    constants = {k: v for k, v in constants.items() if k in names}
    signature = {n: "constexpr" if n in constants else SIGNATURE[n] for n in names}
    # What a launch specializes on the 7B's tensors: 16-byte aligned pointers, a block count divisible by 16
    # (without it the loads are not vectorized)
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constants and n != "seed"
    }
    aligned = {
        k: v for k, v in aligned.items() if signature[names[k[0]]][0] == "*" or names[k[0]] == "n_blocks"
    }
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(
            [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    return instructions, ",".join(re.findall(r"REG:(\d+)", usage))


def _constants(module, rounding_sr: bool) -> tuple[dict, int, int]:
    """The constexprs a revision's kernel takes (its own ROWS and warps), and (elements per program, warps)."""
    rows, block = module.ROWS, module.BLOCK
    warps = getattr(module, "WARPS", 4)
    constants = {
        "STOCHASTIC": True, "STATES_SR": rounding_sr, "V_ROOT4": rounding_sr, "V_POW2": rounding_sr, "ROWS": rows,
        "HALF": block // 2,
        "BLOCK": block, "PHILOX_ROUNDS": getattr(module, "PHILOX_ROUNDS", 10), "V_LINEAR": True,
        "BINARY": getattr(module, "SEARCH", "compares") == "binary",
    }  # fmt: skip
    return constants, rows * block, warps


def _row(label: str, module, arch: int) -> None:
    for sr in (True, False):
        constants, elements, warps = _constants(module, sr)
        n, regs = cost(module._adamw4bit, constants, arch, warps)
        per_thread = elements / (32 * warps)
        what = f"{'stochastic' if sr else 'nearest'} rounding"
        print(f"| {label}: {what} | {elements} / {warps} | {n} | {n / per_thread:.1f} | {regs} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="SM version: 90 (H100/H200), 89 (RTX 4090)")
    parser.add_argument("--ref", nargs="*", default=[], help="adam4bit.py files of other revisions")
    args = parser.parse_args()
    print(
        f"| kernel (sm_{args.arch}) | elements per program / warps | SASS instructions | per element of a thread "
        "| registers per thread |\n|---|---|---|---|---|"
    )
    _row("this revision", adam4bit, args.arch)
    for path in args.ref:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _row(path, module, args.arch)


if __name__ == "__main__":
    main()
