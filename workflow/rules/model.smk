# Models given as GGUF files (llama.cpp's format): imported once into a hub-format directory that every stage loads
# like any other (snaketune.model.gguf).


rule import_gguf:
    input:
        gguf=gguf_input,
    output:
        directory("results/models/{gguf}"),
    log:
        "logs/import_gguf/{gguf}.log",
    benchmark:
        "benchmarks/import_gguf/{gguf}.tsv"
    conda:
        "../../envs/train.yaml"
    threads: 2
    params:
        spec=import_gguf_params,
    script:
        "../scripts/import_gguf.py"
