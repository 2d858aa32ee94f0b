"""The trained model in the hub's layout (output_dir/model: safetensors, config, the tokenizer with the chat template it
trained with), what every later stage loads. With LoRA the adapters are saved first, durable under the checkpoint
directory, then merged into the base weights (QLoRA: into the unquantized base, snaketune.model.build.merge_adapter),
the merged model in model/ and the adapters in model/adapter/."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from snaketune.config.schema import ModelConfig
from snaketune.io import atomic_dir
from snaketune.model.build import merge_adapter
from snaketune.train.summary import RunSetup


def save_model(
    run: RunSetup, engine, model_cfg: ModelConfig, tokenizer, *, ckpt_root: Path, out: Path
) -> None:
    """`engine`'s model into out/model (rank 0 writes; collective: every rank takes part under ZeRO-3, which gathers
    the partitioned weights). `ckpt_root`: the run's checkpoint directory, where LoRA's adapters are kept."""
    engine.module.restore_attention()
    module = engine.module.net
    # Collective under ZeRO-3: every rank takes part in gathering the partitioned weights.
    state = engine._zero3_consolidated_16bit_state_dict() if run.stage == 3 else None
    if state is not None:  # keys of the loss module: "net.<the model's own key>"
        state = {k.removeprefix("net."): v for k, v in state.items()}
    if run.rank == 0:
        adapter = None
        if run.cfg.lora.enabled:
            # Durable before the merge (which loads the base on the host again for QLoRA and can run out of
            # memory): a failed merge loses neither the adapters nor the steps since the last checkpoint.
            adapter = ckpt_root / "adapter"
            with atomic_dir(adapter) as tmp:
                module.save_pretrained(tmp, safe_serialization=True)
        with atomic_dir(out / "model") as tmp:
            if adapter is not None:
                shutil.copytree(adapter, tmp / "adapter")
                _merge(run, model_cfg, module, adapter, ckpt_root).save_pretrained(
                    tmp, safe_serialization=True
                )
            else:
                module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    dist.barrier()


def _merge(
    run: RunSetup, model_cfg: ModelConfig, module: torch.nn.Module, adapter: Path, ckpt_root: Path
) -> torch.nn.Module:
    """The adapters merged into the base weights; QLoRA's into the base's own weights, not into their 4-bit
    rounding (snaketune.model.build.merge_adapter)."""
    try:
        if run.cfg.lora.quantize != "none":
            return merge_adapter(model_cfg, module, run.cfg.lora, dtype=run.dtype)
        return module.merge_and_unload()
    except Exception as e:
        e.add_note(
            f"merging the trained LoRA adapters failed; they are saved in {adapter} and the final "
            f"checkpoint in {ckpt_root}: rerun the job to merge again (it resumes at its last "
            "step and only saves), or merge them yourself with peft "
            "(PeftModel.from_pretrained(base, adapter).merge_and_unload())"
        )
        raise
