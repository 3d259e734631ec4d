"""The model fingerprint a gateway and its workers compare: the same for one model in any folder,
different for another tokenizer or other weights of the same shapes (a fine-tune)."""
from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from shared.model_fingerprint import model_fingerprint


def test_one_model_anywhere_agrees_and_other_weights_or_tokenizer_do_not(served_checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(served_checkpoint, copy)
    assert model_fingerprint(copy) == model_fingerprint(served_checkpoint)
    tuned = tmp_path / "tuned"
    shutil.copytree(served_checkpoint, tuned)
    tensors = load_file(tuned / "model.safetensors")
    save_file({name: t + 1e-3 * torch.randn_like(t) for name, t in tensors.items()}, tuned / "model.safetensors",
              metadata={"format": "pt"})
    assert (tuned / "model.safetensors").stat().st_size == (served_checkpoint / "model.safetensors").stat().st_size
    assert model_fingerprint(tuned) != model_fingerprint(served_checkpoint)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    assert model_fingerprint(copy) != model_fingerprint(served_checkpoint)
