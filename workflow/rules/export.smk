# Export: each experiment's SFT and DPO model as GGUF files for llama.cpp (llama.cpp's converter and quantizer),
# each measured against the model it came from (snaketune.export.export).


rule export:
    input:
        unpack(export_input),
    # update(): a failing job keeps the last good outputs (snaketune.backups).
    output:
        update(directory("results/export/{experiment}/{model}")),
    log:
        "logs/export/{experiment}/{model}.log",
    benchmark:
        "benchmarks/export/{experiment}/{model}.tsv"
    conda:
        "../../envs/export.yaml"
    threads: all_cores
    params:
        spec=export_params,
    script:
        "../scripts/export.py"
