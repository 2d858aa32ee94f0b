# The final report: data stats, training, evaluation and provenance of every experiment in one page.


# The provenance records (not outputs: see snaketune.provenance) of the jobs behind the report, in one file.
rule manifest:
    input:
        unpack(manifest_input),
    output:
        manifest="results/provenance/manifest.json",
    log:
        "logs/manifest.log",
    conda:
        "../../envs/report.yaml"
    threads: 1
    params:
        code=keys.code_hash("manifest"),
    script:
        "../scripts/manifest.py"


rule report:
    input:
        unpack(report_input),
    output:
        html=report(
            "results/report/index.html",
            caption="../report/report_html.rst",
            category="4. Report",
            labels={"file": "index.html"},
        ),
        markdown=report(
            "results/report/report.md",
            caption="../report/report_markdown.rst",
            category="4. Report",
            labels={"file": "report.md"},
        ),
        summary=report(
            "results/report/summary.json",
            caption="../report/report_summary.rst",
            category="4. Report",
            labels={"file": "summary.json"},
        ),
        loss_vs_step=report(
            "results/report/loss_vs_step.png",
            caption="../report/plot_loss_vs_step.rst",
            category="4. Report",
            labels={"file": "loss_vs_step.png"},
        ),
        loss_vs_tokens=report(
            "results/report/loss_vs_tokens.png",
            caption="../report/plot_loss_vs_tokens.rst",
            category="4. Report",
            labels={"file": "loss_vs_tokens.png"},
        ),
        learning_rate=report(
            "results/report/learning_rate.png",
            caption="../report/plot_learning_rate.rst",
            category="4. Report",
            labels={"file": "learning_rate.png"},
        ),
        throughput=report(
            "results/report/throughput.png",
            caption="../report/plot_throughput.rst",
            category="4. Report",
            labels={"file": "throughput.png"},
        ),
        memory=report(
            "results/report/memory.png",
            caption="../report/plot_memory.rst",
            category="4. Report",
            labels={"file": "memory.png"},
        ),
        preference=report(
            "results/report/preference.png",
            caption="../report/plot_preference.rst",
            category="4. Report",
            labels={"file": "preference.png"},
        ),
    log:
        "logs/report.log",
    conda:
        "../../envs/report.yaml"
    threads: 1
    params:
        spec=report_params(),
    script:
        "../scripts/report.py"


# Under benchmark.fail_on_drop (then a target of rule all): the run fails, once the report is written, when the
# report flags a benchmark score lost beyond benchmark.max_drop (snaketune.report.gate says why a rule of its own).
rule benchmark_gate:
    input:
        summary="results/report/summary.json",
    output:
        gate="results/report/gate.json",
    log:
        "logs/benchmark_gate.log",
    localrule: True
    conda:
        "../../envs/report.yaml"
    threads: 1
    params:
        code=keys.code_hash("benchmark_gate"),
    script:
        "../scripts/benchmark_gate.py"
