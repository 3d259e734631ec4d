"""The shipped default model (models/default): a standard Hugging Face folder that
transformers and our engine both load, decode identically, and score to the same
held-out perplexity."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from worker.engine import Engine, SamplingParams
from worker.model.attention import paged_attention_reference
from worker.scoring import score

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
PROMPTS = [
    "The json module",
    "Return the number of items in a container.",
    "class collections.OrderedDict",
    "The \"for\" statement is used to",
]
STANDARD_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_model_dir(MODEL_DIR, num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def heldout_ids(tokenizer):
    return tokenizer((MODEL_DIR / "heldout_sample.txt").read_text())["input_ids"]


def test_folder_is_standard_and_small():
    for name in STANDARD_FILES:
        assert (MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total < 25 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config.get("dtype") or config.get("torch_dtype")) == "float16"


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    text = "Return a new list containing all items from the iterable in ascending order."
    encoded = tokenizer(text)["input_ids"]
    assert encoded[0] == tokenizer.bos_token_id
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What does len do?"}],
                                             tokenize=False, add_generation_prompt=True)
    assert rendered == "<|startoftext|><|user|>\nWhat does len do?<|endoftext|><|assistant|>\n"
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert chat_ids[0] == tokenizer.bos_token_id and chat_ids.count(tokenizer.bos_token_id) == 1


def test_greedy_continuations_match_transformers(tokenizer, hf_model, engine):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # No EOS on either side: the same contract as our ignore_eos.
    config = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None,
                                           pad_token_id=tokenizer.pad_token_id)
    expected = [hf_model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
                for p in prompts]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in ours] == expected
    text = tokenizer.decode(ours[0].token_ids, skip_special_tokens=True)
    words = [w for w in text.split() if w.strip(".,:;()`'\"").isalpha()]
    assert len(words) >= 8, text  # readable words, not byte soup


def _transformers_nll(model, ids: list[int], window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = torch.tensor(ids[start:start + window])
        with torch.no_grad():
            logits = model(chunk[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return nll, count


def test_heldout_perplexity_matches_transformers(hf_model, engine, heldout_ids):
    window = engine.model_config.max_position_embeddings
    assert len(heldout_ids) > 3 * window  # several windows, the last one partial
    nll, count = _transformers_nll(hf_model, heldout_ids, window)
    theirs = math.exp(nll / count)
    ours = score(engine.model, heldout_ids, window=window, block_size=engine.config.block_size)
    assert ours.num_predicted == count
    assert abs(ours.perplexity - theirs) / theirs < 0.01, (ours.perplexity, theirs)
    # And the figure the model card quotes, recorded at training time.
    recorded = json.loads((MODEL_DIR / "training_log.json").read_text())["heldout_sample_perplexity"]
    assert abs(theirs - recorded) / recorded < 0.01
    assert theirs < 100


def test_scoring_paths_agree(engine, heldout_ids):
    """Chunked prefill over the paged cache and the reference attention score alike."""
    ids = heldout_ids[:300]
    whole = score(engine.model, ids, window=300, chunk_size=300)
    chunked = score(engine.model, ids, window=300, chunk_size=37, attention_fn=paged_attention_reference)
    assert chunked.num_predicted == whole.num_predicted == 299
    assert abs(chunked.nll - whole.nll) / whole.nll < 1e-4
