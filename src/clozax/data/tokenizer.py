"""The frozen subword tokenizer: trained on the train split only, or given as a file.

Determinism: HF ``tokenizers``' BPE trainer without a subword prefix or suffix gives the same
vocabulary in every process; its WordPiece trainer does not (huggingface/tokenizers #1794,
hash-map iteration order). So ``bpe`` is the default. Its pre-tokeniser splits like BERT's
(on whitespace and punctuation) but marks word starts with ``▁`` (Metaspace), so ``decode``
restores spaces without a prefix/suffix that would break determinism.

``train_task`` is ``clozax prepare``'s tokenizer phase: it trains on the kept train documents
that ``data/spool.py`` reads back (or their keyed sample).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from clozax.core.vocab import SPECIAL_NAMES, SPECIAL_TOKENS
from clozax.data.split import TRAIN
from clozax.data.spool import Sample, kept_lines

TOKENIZER_MODELS = ("bpe", "wordpiece")
_WORD_MARK = "\u2581"  # ▁
# The specials' strings of a given tokenizer, tried in this order: BERT's (also clozax's own
# and ModernBERT's), RoBERTa's (also RoBERTa-PreLayerNorm's, XLM-R's); ``--special-tokens``
# names any that differ.
STYLES = {"bert": SPECIAL_TOKENS,
          "roberta": {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>",
                      "mask": "<mask>"}}


def train_tokenizer(texts: Iterable[str], *, model: str, vocab_size: int, lowercase: bool,
                    length: int | None = None) -> Tokenizer:
    """Train a tokenizer whose specials sit at ids 0..4 in ``SPECIAL_NAMES`` order."""
    specials = [SPECIAL_TOKENS[name] for name in SPECIAL_NAMES]
    bert_normaliser = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=False)
    if model == "bpe":
        tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk"]))
        tok.normalizer = normalizers.Sequence(
            [bert_normaliser, normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Metaspace(replacement=_WORD_MARK, prepend_scheme="always"),
            pre_tokenizers.Punctuation(),
        ])
        tok.decoder = decoders.Metaspace(replacement=_WORD_MARK, prepend_scheme="always")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      show_progress=False)
    elif model == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS["unk"]))
        tok.normalizer = bert_normaliser
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                            show_progress=False)
    else:
        raise ValueError(f"tokenizer model {model!r} is unknown; use one of "
                         f"{', '.join(TOKENIZER_MODELS)}")
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for the {len(specials)} special tokens "
            f"plus the train split's alphabet ({tok.get_vocab_size()} entries needed); raise "
            f"--vocab-size to at least {tok.get_vocab_size()}")
    ids = find_specials(tok)
    assert list(ids.values()) == list(range(len(SPECIAL_NAMES))), ids
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS['cls']} $A {SPECIAL_TOKENS['sep']}",
        pair=f"{SPECIAL_TOKENS['cls']} $A {SPECIAL_TOKENS['sep']} $B:1 {SPECIAL_TOKENS['sep']}:1",
        special_tokens=[(SPECIAL_TOKENS["cls"], ids["cls"]), (SPECIAL_TOKENS["sep"], ids["sep"])],
    )
    return tok


def train_task(tmp: str, pieces: list[int], threshold: int | None, seed: int,
               options: dict) -> None:
    """Train the tokenizer on the kept train documents (or their sample) and save it as
    ``tokenizer.json.partial``."""
    tmp = Path(tmp)
    texts = Sample(None, seed).chosen(kept_lines(tmp, TRAIN, pieces), threshold)
    tok = train_tokenizer(texts, **options)
    tok.save(str(tmp / "tokenizer.json.partial"))


def parse_special_tokens(text: str | None) -> dict[str, str]:
    """``"mask=<blank>,pad=<pad>"`` as ``{name: string}``; ValueError naming a bad entry."""
    names: dict[str, str] = {}
    for entry in (text or "").split(","):
        name, eq, string = entry.strip().partition("=")
        if not eq or name not in SPECIAL_NAMES or not string or name in names:
            raise ValueError(f"--special-tokens entry {entry.strip()!r} is not NAME=STRING with "
                             f"a NAME of {', '.join(SPECIAL_NAMES)} given once; e.g. "
                             "--special-tokens mask=<mask>,cls=<s>")
        names[name] = string
    return names


def find_specials(tok: Tokenizer, names: dict[str, str] | None = None) -> dict[str, int]:
    """Ids of the five specials by name: ``names`` (strings by name) for those given, the
    rest in the first of ``STYLES`` the tokenizer has them all in; an error saying what is
    missing and how to name it otherwise."""
    names = names or {}
    missing = {}
    for style, strings in STYLES.items():
        wanted = {**strings, **names}
        ids = {name: tok.token_to_id(wanted[name]) for name in SPECIAL_NAMES}
        missing[style] = [wanted[name] for name, i in ids.items() if i is None]
        if missing[style]:
            continue
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"tokenizer maps two special tokens to one id ({ids}); give each "
                             "special its own token with --special-tokens")
        return {name: int(i) for name, i in ids.items()}
    lacks = "; ".join(f"{style}: {' '.join(m)}" for style, m in missing.items())
    raise ValueError(f"tokenizer lacks special token(s) ({lacks}); name its own with "
                     "--special-tokens pad=…,unk=…,cls=…,sep=…,mask=…, or let `clozax prepare` "
                     "train one (drop --tokenizer)")


def special_strings(tok: Tokenizer, ids: dict[str, int]) -> dict[str, str]:
    """Each special's string in ``tok``, by name."""
    return {name: tok.id_to_token(int(ids[name])) for name in SPECIAL_NAMES}


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a ``tokenizer.json`` unchanged; ``ValueError`` when it cannot be loaded (its
    specials: ``find_specials``, or the ids a dataset or run records)."""
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} does not exist; pass an existing "
                         "tokenizer.json or drop --tokenizer to train one")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"tokenizer file {path} is not a valid tokenizer.json "
                         f"({str(e).splitlines()[0][:200]}); pass a file saved by "
                         "HF tokenizers") from None
    return tok
