import _stage

import torch

from snaketune.model.gguf import import_gguf


def main(smk):
    torch.set_num_threads(smk.threads)
    import_gguf(smk.input.gguf, smk.output[0], trust_remote_code=smk.params.spec["trust_remote_code"])


_stage.run(snakemake, main)
