"""Document-bounded attention (seekspeed.data.attention "document"): the mask, and a
packed row whose documents give exactly the logits each document gives alone (RoPE
is relative, so a document's place in the row does not matter), dense and MoE; the
config's refusals. Single process; about 5 s. The pipelined run with the ids
travelling between stages is in test_pipeline_parity.py."""

import pytest
import torch

from ds_ext.errors import ConfigError
from recipes import deepseek_v3
from recipes.layers.pipe import document_mask
from recipes.layers.reference import SequentialReference
from tests.training import write_config

EOS = 256


def test_mask_keeps_each_token_in_its_document():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, 8]])
    mask = document_mask(ids, EOS)[0, 0]
    doc = [0, 0, 0, 1, 1, 2]            # an end token belongs to the document it ends
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (j <= i and doc[i] == doc[j]), (i, j)


def _documents(lengths, *, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        body = torch.randint(0, vocab - 1, (n,), generator=g)
        body[body == EOS] = EOS + 1
        docs.append(torch.cat([body, torch.tensor([EOS])]))
    return docs


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_packed_documents_equal_each_document_alone(preset):
    torch.manual_seed(0)
    config = deepseek_v3.make_config(preset)
    bounded = SequentialReference(deepseek_v3.layer_specs(config, seed=3, document_token=EOS)).eval()
    causal = SequentialReference(deepseek_v3.layer_specs(config, seed=3)).eval()
    docs = _documents([9, 23, 14, 17], vocab=config.vocab_size, seed=1)
    row = torch.cat(docs).unsqueeze(0)
    with torch.no_grad():
        packed = bounded(row)[0]
        crossing = causal(row)[0]
        start = 0
        for doc in docs:
            alone = causal(doc.unsqueeze(0))[0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, rtol=1e-4, atol=1e-5)
            if start:        # plain causal attention over the row does see the earlier documents
                assert not torch.allclose(crossing[start:start + len(doc)], alone, rtol=1e-3, atol=1e-3)
            start += len(doc)


def test_config_refusals(tmp_path):
    from ds_ext import trainer
    from ds_ext.config import load_config
    with pytest.raises(ConfigError, match="attention 'sliding' is not one of"):
        load_config(write_config(tmp_path, "tiny_cpu.json", lambda c: c["seekspeed"]["data"].update(attention="sliding")),
                    world_size=2)

    def document_with_mtp(c):
        c["seekspeed"]["data"]["attention"] = "document"
        c["seekspeed"]["recipe"]["overrides"] = {"num_mtp_layers": 1}
    path = write_config(tmp_path, "tiny_cpu.json", document_with_mtp)
    with pytest.raises(ConfigError, match="does not support multi-token prediction"):
        trainer.validate(trainer.parse_args(["--deepspeed", path, "--checkpoint-dir", str(tmp_path / "c")]),
                         world_size=2)
