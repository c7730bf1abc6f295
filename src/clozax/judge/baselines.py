"""The baselines an encoder is compared with, one implementation each for ``probe`` and
``finetune``: a linear classifier on fixed features (an encoder's frozen features, or TF-IDF of
the text) with ``C`` chosen on validation, and the best input-blind predictor.

The linear classifier: multinomial logistic regression (scikit-learn), fitted on the training
split for each ``C`` of ``C_GRID``; the ``C`` with the best validation score (ties: the stronger
regularisation) is kept and scores the test split. No refit on train + validation: the
fine-tuning jobs never train on validation either.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from clozax.judge.finetune import heads, tasks

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)


def linear_classifier(x: dict, task: tasks.Task, metric: str, standardise: bool) -> dict:
    """``x``: features per split (train, validation, test). Returns C, the validation score of
    every C, the chosen C's validation and test metrics and its test predictions."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    def model(c):
        clf = LogisticRegression(C=c, max_iter=2000)
        return make_pipeline(StandardScaler(), clf) if standardise else clf

    y = {name: np.asarray(split.y) for name, split in task.splits.items()}
    best, by_c = None, {}
    # One BLAS thread: on a small, busy machine threaded BLAS is ~10x slower for these sizes.
    with threadpool_limits(limits=1):
        for c in C_GRID:
            fitted = model(c).fit(x["train"], y["train"])
            val = heads.metrics(task.kind, y["validation"], fitted.predict(x["validation"]),
                                task.labels)
            by_c[f"{c:g}"] = val[metric]
            if best is None or val[metric] > best[1][metric]:
                best = (c, val, fitted)
        c, val, fitted = best
        pred = fitted.predict(x["test"])
    return {"C": c, "validation_by_C": by_c, "validation": val,
            "test": heads.metrics(task.kind, y["test"], pred, task.labels), "test_pred": pred}


def tfidf_features(task: tasks.Task) -> dict:
    """TF-IDF (sublinear tf, l2-normalised) of each split's text, the vocabulary from train."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(sublinear_tf=True).fit(task.splits["train"].text)
    return {name: vec.transform(split.text) for name, split in task.splits.items()}


def tfidf_baseline(task: tasks.Task, metric: str | None = None) -> dict:
    """TF-IDF + logistic regression (classification kinds), C chosen on ``metric``."""
    return linear_classifier(tfidf_features(task), task, metric or task.metric,
                             standardise=False)


def constant_baseline(task: tasks.Task) -> dict:
    """The best input-blind predictor from training: the majority class (tag), or the mean."""
    train, test = task.splits["train"], task.splits["test"]
    if task.kind == "regression":
        mean = float(np.mean(train.y))
        return heads.metrics("regression", test.y, [mean] * len(test))
    if task.kind == "tokens":
        common = Counter(int(t) for y in train.y for t in y if t >= 0).most_common(1)[0][0]
        y_true = [np.asarray(y)[np.asarray(y) >= 0] for y in test.y]
        return heads.metrics("tokens", y_true, [np.full_like(t, common) for t in y_true],
                             task.labels)
    common = Counter(train.y).most_common(1)[0][0]
    return heads.metrics(task.kind, test.y, [common] * len(test), task.labels)
