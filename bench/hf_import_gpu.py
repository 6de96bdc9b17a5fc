"""GPU check: a Hugging Face folder as ``checkpoint.initial_load_path`` under FSDP on CUDA.

What it verifies (CPU tests cover gloo; this covers CUDA + NCCL): the HF loader
(``titan_core/initial_weights.py``) reads the safetensors on each rank, ``set_model_state_dict``
shards them onto CUDA FSDP parameters, and step 1's loss equals the loss of the same weights on the
CPU in float32 (relative 1e-4, TF32 off). No ``transformers`` needed: ``prepare`` writes the folder
with titan's own adapter (``to_hf`` + ``hf_config``) and ``safetensors``.

    python bench/hf_import_gpu.py prepare /tmp/hf_gpu
    torchrun --nproc_per_node=2 bench/hf_import_gpu.py check /tmp/hf_gpu

``check`` exits 0 and prints ``hf import on cuda: PASS ...`` on rank 0, or exits 1 with FAIL.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from tests.parallel_harness import tiny_config
from titan_core._registry import get_registry

MODEL = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}


def _config(folder: Path, device: str, world: int):
    config = tiny_config(
        **{
            "job.dump_folder": str(folder / f"run_{device}"),
            "model.overrides": MODEL,
            "checkpoint.initial_load_path": str(folder / "hf"),
            "training.steps": 1,
            "training.device": device,
            "parallelism.dp_shard": world,
            "training.local_batch_size": 4 // world,
        }
    )
    return config


def prepare(folder: Path) -> None:
    from safetensors.torch import save_file

    from titan_core.trainer import Trainer

    spec = get_registry().get("models", "llama3")
    args = spec.flavor("debugmodel", MODEL)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    adapter = spec.state_dict_adapter
    (folder / "hf").mkdir(parents=True, exist_ok=True)
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict(), args).items()}
    save_file(hf, str(folder / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "hf" / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    # The CPU float32 reference: the loss of these weights on the first global batch.
    trainer = Trainer(_config(folder, "cpu", 1), get_registry())
    inputs, labels = next(iter(trainer.batches))
    with torch.no_grad():
        loss = F.cross_entropy(trainer.parts[0](inputs).flatten(0, 1).float(), labels.flatten())
    trainer.close(completed=True)
    (folder / "reference.json").write_text(json.dumps({"loss": float(loss)}))
    print(f"prepared {folder}: reference loss {float(loss):.6f}")


def check(folder: Path) -> int:
    from titan_core.trainer import train

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    history = train(_config(folder, "cuda", world), get_registry())
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    expected = json.loads((folder / "reference.json").read_text())["loss"]
    got = history[0]["loss"]
    ok = abs(got - expected) <= 1e-4 * abs(expected)
    verdict = "PASS" if ok else "FAIL"
    print(f"hf import on cuda: {verdict} step-1 loss {got:.6f} vs CPU {expected:.6f} ({world} GPUs)")
    return 0 if ok else 1


if __name__ == "__main__":
    command, target = sys.argv[1], Path(sys.argv[2])
    if command == "prepare":
        prepare(target)
        sys.exit(0)
    sys.exit(check(target))
