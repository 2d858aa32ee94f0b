import _stage

from pathlib import Path

from snaketune import gpus
from snaketune.benchmark.run import benchmark


def main(smk):
    spec = dict(smk.params.spec)
    spec.pop("code")
    source = dict(spec.pop("source"))
    if source["kind"] == "gguf":
        source["gguf"] = str(Path(smk.input.export) / source.pop("file"))
    else:
        import torch

        torch.set_num_threads(smk.threads)
        if source["kind"] == "tuned":
            source["dir"] = smk.input.model
    # A transformers model takes a GPU of its own where there are some (CUDA_VISIBLE_DEVICES set before CUDA
    # starts here); the GGUF files run on llama.cpp's CPU build and take none.
    with gpus.in_process(int(getattr(smk.resources, "gpu", 0)), label=f"benchmark {source['label']}"):
        benchmark(
            source=source,
            tasks=[spec.pop("task")],
            outs=[smk.output[0]],
            tokenizer_dir=Path(smk.input.tokenizer).parent,
            threads=smk.threads,
            **spec,
        )


_stage.run(snakemake, main)
