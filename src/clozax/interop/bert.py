"""``BertForMaskedLM`` (and the bare ``BertModel``): clozax runs with ``layer_norm="post"``.

Each clozax leaf and its tensor (``i`` indexes the leading ``layers`` axis; kernels are
transposed, ``(in, out)`` here and ``(out, in)`` in HF):

====================================  ===================  ====================================
clozax leaf                           shape                HF tensor (``bert.`` prefix)
====================================  ===================  ====================================
embeddings.word                       (vocab, hidden)      embeddings.word_embeddings.weight
                                                           (also the tied decoder weight)
embeddings.position                   (max_pos, hidden)    embeddings.position_embeddings.weight
embeddings.layer_norm.{scale,bias}    (hidden,)            embeddings.LayerNorm.{weight,bias}
layers.attention.{query,key,value}.*  (layers, hid, hid)   encoder.layer.i.attention.self.{q,k,v}
layers.attention.output.*             (layers, hid, hid)   ... .attention.output.dense.*
layers.attention_norm.{scale,bias}    (layers, hidden)     ... .attention.output.LayerNorm.*
layers.intermediate.*                 (layers, hid, int)   ... .intermediate.dense.*
layers.output.*                       (layers, int, hid)   ... .output.dense.*
layers.mlp_norm.{scale,bias}          (layers, hidden)     ... .output.LayerNorm.*
head.transform.*                      (hid, hid)           cls.predictions.transform.dense.*
head.layer_norm.{scale,bias}          (hidden,)            cls.predictions.transform.LayerNorm.*
head.bias                             (vocab,)             cls.predictions.bias
====================================  ===================  ====================================

HF BERT uses ``hidden_act="gelu"`` (exact erf), which is what clozax computes.
"""

from clozax.interop.family import Family

BERT = Family(
    layer_norm="post",
    model_type="bert",
    mlm="BertForMaskedLM",
    encoder="BertModel",
    prefix="bert.",
    head="cls.predictions.",
    head_transform="transform.dense",
    head_norm="transform.LayerNorm",
    attention_norm="attention.output.LayerNorm",
    mlp_norm="output.LayerNorm",
    final_norm=None,
    specials={"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    positions_after_pad=False,
)
