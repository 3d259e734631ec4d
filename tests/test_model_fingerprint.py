"""The model fingerprint a gateway and its workers compare: the same for one model in any folder,
different for another tokenizer or other weights of the same shapes (a fine-tune)."""
from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from shared.model_fingerprint import model_fingerprint


def _header(path) -> bytes:
    raw = path.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


def test_one_model_anywhere_agrees_and_other_weights_or_tokenizer_do_not(served_checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(served_checkpoint, copy)
    assert model_fingerprint(copy) == model_fingerprint(served_checkpoint)
    tuned = tmp_path / "tuned"
    shutil.copytree(served_checkpoint, tuned)
    tensors = load_file(tuned / "model.safetensors")
    save_file({name: t + 1e-3 * torch.randn_like(t) for name, t in tensors.items()}, tuned / "model.safetensors",
              metadata={"format": "pt"})
    # The same header (names, dtypes, shapes, offsets) and size: only the weight sample can tell them apart.
    assert _header(tuned / "model.safetensors") == _header(served_checkpoint / "model.safetensors")
    assert model_fingerprint(tuned) != model_fingerprint(served_checkpoint)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    assert model_fingerprint(copy) != model_fingerprint(served_checkpoint)


def test_a_worker_of_another_fingerprint_scheme_is_refused_naming_the_versions(served_checkpoint, caplog):
    """A gateway and a worker of different versions of this project compute their fingerprints
    differently: the refusal says so rather than call it another model."""
    import logging

    from gateway.model_check import ModelCheck
    from protos import worker_pb2
    check = ModelCheck(str(served_checkpoint))
    caplog.set_level(logging.ERROR, logger="gateway.model_check")

    def heartbeat(incarnation: str, fingerprint: str):
        return worker_pb2.Envelope(worker_id="w", incarnation=incarnation, heartbeat=worker_pb2.Heartbeat(
            model_fingerprint=fingerprint, model_name="llama"))

    assert check.admits(heartbeat("i1", model_fingerprint(served_checkpoint))) == (True, False)
    assert check.admits(heartbeat("i2", "0123456789abcdef")) == (False, True)  # the scheme before v2
    assert "fingerprints its model by scheme v1, this gateway by v2" in caplog.records[-1].getMessage()
    assert check.admits(heartbeat("i3", "v2-0123456789abcdef")) == (False, True)
    assert "it serves llama (fingerprint v2-0123456789abcdef)" in caplog.records[-1].getMessage()
