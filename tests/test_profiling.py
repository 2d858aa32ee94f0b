"""SNAKETUNE_PROFILE (snaketune.train.profiling): a trace of a few training steps and the table of where they went."""

from __future__ import annotations

import gzip
import json

import torch

from snaketune.train import profiling


def test_profiler_writes_a_trace_and_a_table_of_the_profiled_steps(tmp_path):
    prof = profiling.StepProfiler(tmp_path, rank=0, device=torch.device("cpu"))
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(net.parameters())
    for _ in range(profiling.WAIT + profiling.WARMUP + profiling.ACTIVE + 2):
        net(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        prof.step()
    prof.close()
    trace = json.loads(gzip.decompress((tmp_path / "trace_rank0.json.gz").read_bytes()))
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == profiling.ACTIVE, sorted(steps)  # the schedule's active steps, and only those
    table = (tmp_path / "top_rank0.md").read_text()
    assert f"over {profiling.ACTIVE} profiled steps" in table and "aten::addmm" in table


def test_kernel_table_groups_gpu_kernels_into_families():
    """On the GPU only the trace's kernel events count (not the host operators that launched them)."""
    events = [
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dur": 600.0},
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dur": 300.0},
        {"cat": "kernel", "name": "adamw", "dur": 300.0},
        {"cat": "kernel", "name": "_rms_norm_backward_kernel", "dur": 60.0},
        {"cat": "kernel", "name": "void pytorch_flash::flash_fwd_kernel<...>", "dur": 30.0},
        {"cat": "kernel", "name": "cross_entropy_backward", "dur": 30.0},  # snaketune.model.losses
        {
            "cat": "kernel",
            "name": "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::"
            "NormTwoOps<c10::BFloat16, float, float>, unsigned int, float, 4, 4> >(...)",  # the gradient norm
            "dur": 60.0,
        },
        {"cat": "cpu_op", "name": "aten::mm", "dur": 5000.0},
    ]
    times = profiling.kernel_times({"traceEvents": events})
    assert times["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"] == (2, 900.0) and "aten::mm" not in times
    table = profiling.top_table(times)
    assert "| matmul (cuBLAS/CUTLASS) | 0.30 | 65.2% |" in table
    assert "| optimizer step (AdamW, gradient norm) | 0.12 | 26.1% |" in table
    assert "fused Triton (Liger RMSNorm/RoPE/SwiGLU, losses) | 0.03 | 6.5% |" in table


def test_gpu_busy_is_the_union_of_kernel_intervals_against_the_steps_wall_time():
    """Overlapping kernels (two streams) count once; a gap (the GPU waiting for the host) does not count."""
    steps = [
        {"name": f"ProfilerStep#{i}", "cat": "user_annotation", "ts": 1000.0 * i, "dur": 1000.0}
        for i in (3, 4, 5)
    ]
    # the same markers on the GPU's timeline are not more steps
    steps += [{**e, "cat": "gpu_user_annotation", "ts": e["ts"] + 50} for e in steps]
    kernels = [
        {"cat": "kernel", "name": "a", "ts": 3000.0, "dur": 400.0},
        {"cat": "kernel", "name": "b", "ts": 3200.0, "dur": 400.0},  # overlaps a: 3000-3600 busy
        {"cat": "gpu_memcpy", "name": "copy", "ts": 4000.0, "dur": 300.0},
        {"cat": "kernel", "name": "c", "ts": 5500.0, "dur": 100.0},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 3000.0, "dur": 3000.0},  # host time is not GPU time
    ]
    line = profiling.gpu_busy_line({"traceEvents": steps + kernels})
    assert line == "GPU busy (kernels, copies) 0.3 of 1.0 ms of wall time per step: 33%"
