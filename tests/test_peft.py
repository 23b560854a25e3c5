"""PEFT with the module names users type: `q_proj`, `k_proj`, `v_proj`, `out_proj`, `fc1`, `fc2`.

- `LoraConfig(target_modules=["q_proj", "v_proj"])` adapts the query and value projection of every attention layer
  (encoder self-attention, decoder self-attention and encoder-decoder attention), and nothing else;
- `LoraConfig()` without target modules does the same (the default mapping for model_type "vaswani");
- a LoRA fine-tune trains only the adapters, lowers the loss, and `generate()` uses the adapters (its packed CPU
  path does not bypass them): it gives what the merged model gives; adapters save and load back.
"""

import pytest
import torch
from helpers import padded_batch, tiny_model

peft = pytest.importorskip("peft", reason="needs PEFT: pip install peft")


def _adapted(model) -> set[str]:
    return {name.removesuffix(".lora_A") for name, _ in model.named_modules() if name.endswith(".lora_A")}


def _expected(model, names=("q_proj", "v_proj")) -> set[str]:
    config = model.config
    attentions = [f"model.encoder.layers.{i}.self_attn" for i in range(config.encoder_layers)]
    attentions += [f"model.decoder.layers.{i}.{kind}" for i in range(config.decoder_layers)
                   for kind in ("self_attn", "encoder_attn")]
    return {f"base_model.model.{attention}.{name}" for attention in attentions for name in names}


def test_q_proj_and_v_proj_adapt_every_attention_layer():
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapted = _adapted(model)
    assert adapted == _expected(model.base_model.model)
    assert len(adapted) == 2 * (2 + 2 * 2)  # q and v of 2 encoder and 2 x 2 decoder attentions


def test_the_default_target_modules_are_query_and_value():
    config = peft.LoraConfig(r=4, task_type=peft.TaskType.SEQ_2_SEQ_LM)  # no target_modules
    model = peft.get_peft_model(tiny_model(), config)
    assert _adapted(model) == _expected(model.base_model.model)


def test_lora_fine_tune_trains_the_adapters_and_generate_uses_them(tmp_path):
    torch.manual_seed(0)
    base = tiny_model(dropout=0.0)
    frozen = {name: p.detach().clone() for name, p in base.named_parameters()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
                             task_type=peft.TaskType.SEQ_2_SEQ_LM)
    model = peft.get_peft_model(base, config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    ids, mask = padded_batch(length=9)
    labels, label_mask = padded_batch(seed=3, length=6)
    labels = labels.masked_fill(label_mask.eq(0), -100)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(30):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    for name, p in model.base_model.model.named_parameters():  # the base weights did not move
        key = name.replace(".base_layer", "")
        if key in frozen:
            assert torch.equal(p, frozen[key]), name
    model.eval()
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=6)
    with torch.no_grad():
        adapted = model.generate(**kwargs)
        plain = tiny_model(dropout=0.0).generate(**kwargs)
    assert not torch.equal(adapted, plain)  # the adapters change the translations

    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(tiny_model(dropout=0.0), tmp_path).eval()
    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        assert torch.equal(merged.generate(**kwargs), adapted)
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   model(input_ids=ids, attention_mask=mask, labels=labels).loss, atol=1e-5, rtol=0)
