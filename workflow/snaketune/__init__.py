"""snaketune: fine-tune DeepSeek LLMs on oasst1-format data, one importable module per workflow stage.

Stages: download -> conversations -> tokenizer -> tokenization -> train. The Snakemake scripts under
workflow/scripts/ are thin shells over these modules; tests import the modules directly.
"""

__version__ = "0.1.0"
