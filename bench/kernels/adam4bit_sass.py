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
    "m_qmap": "*fp32", "v_qmap": "*fp32", "partial_ptr": "*fp32", "divisor_ptr": "*fp32", "n_blocks": "i32",
    "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "decay": "fp32", "step_size": "fp32",
    "bc2_sqrt": "fp32", "seed": "i32",
}  # fmt: skip
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def cost(fn, constants: dict, arch: int) -> tuple[int, str]:
    """(SASS instructions, registers per thread) of the kernel `fn` with these constexprs, bf16 weights."""
    signature = {**SIGNATURE, **{name: "constexpr" for name in constants}}
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", arch, 32)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="SM version: 90 (H100/H200), 89 (RTX 4090)")
    parser.add_argument("--ref", nargs="*", default=[], help="adam4bit.py files of other revisions")
    args = parser.parse_args()
    shape = {"STOCHASTIC": True, "ROWS": adam4bit.ROWS, "HALF": adam4bit.BLOCK // 2}
    print(f"| kernel (sm_{args.arch}) | SASS instructions | registers per thread |\n|---|---|---|")
    for sr in (True, False):
        n, regs = cost(adam4bit._adamw4bit, {**shape, "STATES_SR": sr}, args.arch)
        what = f"{'stochastic' if sr else 'nearest'} rounding"
        print(f"| this revision: {what} | {n} | {regs} |")
    for path in args.ref:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        params = module._adamw4bit.arg_names
        # V_LINEAR: revisions that had a formula for the codes of torchao's linear map
        extra = {name: True for name in ("STATES_SR", "V_LINEAR") if name in params}
        n, regs = cost(module._adamw4bit, {**shape, **extra}, args.arch)
        print(f"| {path} ({', '.join(f'{k}={v}' for k, v in extra.items()) or 'nearest'}) | {n} | {regs} |")


if __name__ == "__main__":
    main()
