"""``RobertaPreLayerNormForMaskedLM`` (and the bare encoder): clozax runs with
``layer_norm="pre"``.

Each clozax leaf and its tensor (``i`` indexes the leading ``layers`` axis; kernels are
transposed, ``(in, out)`` here and ``(out, in)`` in HF):

====================================  ===================  ====================================
clozax leaf                           shape                HF tensor (``roberta_prelayernorm.``)
====================================  ===================  ====================================
embeddings.word                       (vocab, hidden)      embeddings.word_embeddings.weight
                                                           (also the tied decoder weight)
embeddings.position                   (max_pos, hidden)    embeddings.position_embeddings.weight
                                                           (row p -> p + pad + 1)
embeddings.layer_norm.{scale,bias}    (hidden,)            embeddings.LayerNorm.{weight,bias}
layers.attention.{query,key,value}.*  (layers, hid, hid)   encoder.layer.i.attention.self.{q,k,v}
layers.attention.output.*             (layers, hid, hid)   ... .attention.output.dense.*
layers.attention_norm.{scale,bias}    (layers, hidden)     ... .attention.LayerNorm.*
layers.intermediate.*                 (layers, hid, int)   ... .intermediate.dense.*
layers.output.*                       (layers, int, hid)   ... .output.dense.*
layers.mlp_norm.{scale,bias}          (layers, hidden)     ... .intermediate.LayerNorm.*
final_norm.{scale,bias}               (hidden,)            LayerNorm.{weight,bias}
head.transform.*                      (hid, hid)           lm_head.dense.*
head.layer_norm.{scale,bias}          (hidden,)            lm_head.layer_norm.*
head.bias                             (vocab,)             lm_head.bias
====================================  ===================  ====================================

RoBERTa-PreLayerNorm position ids are ``cumsum(input_ids != pad) + pad``: the first token sits
at row ``pad + 1``. So clozax row ``p`` is HF row ``p + pad + 1`` and the HF table has
``max_positions + pad + 1`` rows (rows ``0..pad`` unused by real tokens, written as zeros).
Parity holds for right-padded batches; with left padding HF shifts real tokens' positions and
clozax does not (clozax positions are indices).
"""

from clozax.interop.family import Family

ROBERTA_PRELAYERNORM = Family(
    layer_norm="pre",
    model_type="roberta-prelayernorm",
    mlm="RobertaPreLayerNormForMaskedLM",
    encoder="RobertaPreLayerNormModel",
    prefix="roberta_prelayernorm.",
    head="lm_head.",
    head_transform="dense",
    head_norm="layer_norm",
    attention_norm="attention.LayerNorm",
    mlp_norm="intermediate.LayerNorm",
    final_norm="LayerNorm",
    specials={"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"},
    positions_after_pad=True,
)
