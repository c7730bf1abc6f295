"""The audit finds each planted fault, and only that one.

One tiny run (5 steps) per module. The first test runs the whole audit on it through the CLI;
each later test swaps one piece (masker, train step, boundary, loss) or corrupts one file and
runs the whole audit again, asserting that exactly the check for that fault fails. The audit
caches compiled default pieces, so only the swapped piece is compiled again.
The 1-vs-N-devices check needs several devices, which must be set before JAX starts: it runs in
a subprocess with 4 simulated CPU devices, started as soon as the run exists.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from clozax.core import masking
from clozax.core.masking import Kind
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import data_files, file_records, fingerprint
from clozax.judge import audit
from conftest import simulated_devices

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.steps=5", "train.batch_size=8", "train.eval_rows=32", "train.eval_every=5",
        "train.save_every=5", "train.log_every=5", "optim.warmup_steps=2"]

DEVICE_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import test_audit as t
from clozax.judge import audit
from clozax.train.run_dir import load_run
loaded = load_run({run!r})
dataset = audit.open_dataset_for_audit({data!r})
only = ["device_accumulation"]
out = {{}}
for name, step in (("default", None), ("device_mean", t.part_mean_step("device", dataset))):
    report = audit.run(loaded.config, dataset, params=loaded.params, make_step=step, only=only,
                       batches=1, leak_batches=1)
    out[name] = report
print("RESULT" + json.dumps(out))
"""


class Tiny(NamedTuple):
    run: Path
    data: Path
    loaded: object
    dataset: object
    devices: subprocess.Popen


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    from clozax.train.run_dir import load_run

    # The shared session fixtures: a small prepared built-in corpus and a tiny run (copied,
    # since the audit writes audit.json into the run directory).
    data = request.getfixturevalue("stdlib_data")
    run = tmp_path_factory.mktemp("audit") / "run"
    shutil.copytree(request.getfixturevalue("tiny_run"), run)
    script = DEVICE_SCRIPT.format(tests=str(Path(__file__).parent), run=str(run), data=str(data))
    env = simulated_devices(4)
    devices = subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield Tiny(run, Path(data), load_run(run), audit.open_dataset_for_audit(data), devices)
    if devices.poll() is None:
        devices.kill()
        devices.communicate()


def audit_with(tiny: Tiny, dataset=None, **pieces) -> dict:
    return audit.run(tiny.loaded.config, dataset or tiny.dataset, params=tiny.loaded.params,
                     run_dir=tiny.run, **pieces)


def failed(report: dict) -> set[str]:
    return {c["name"] for c in report["checks"] if not c["passed"]}


def vocab_of(dataset):
    return Vocabulary(dataset.vocab_size, dataset.specials)


# --------------------------------------------------------------------------- planted faults


def copy_at_mask_masker(dataset, config):
    """The clean id copied into the input at mask positions."""
    base = audit.default_masker(config, vocab_of(dataset), dataset.seq_len)

    def masker(key, batch):
        masked, selection = base(key, batch)
        inputs = jnp.where(masked.kind == Kind.MASK, batch["tokens"], masked.inputs)
        return masked._replace(inputs=inputs), selection

    return masker


def padding_eligible_masker(dataset, config):
    """Eligibility that forgets padding: positions with segment 0 may be selected."""
    vocab = vocab_of(dataset)
    count = masking.selection_count(config.masking.rate, dataset.seq_len)
    special = np.zeros(vocab.size, bool)
    special[list(vocab.special_ids)] = True
    special = jnp.asarray(special)
    pool = jnp.asarray(masking.allowed_random_ids(vocab.size, vocab.special_ids))

    def masker(key, batch):
        tokens, segments = batch["tokens"], batch["segments"]
        eligible = ~special[tokens] | (segments == 0)  # the bug
        select_key, corrupt_key = jax.random.split(key)
        selection = masking.select_fixed(select_key, eligible, count)
        selected = masking.selection_mask(selection, tokens.shape[1])
        return masking.corrupt(corrupt_key, tokens, selected, config.masking.policy,
                               vocab.specials["mask"], pool), selection

    return masker


def part_mean_step(part: str, dataset):
    """A train step that divides too early: a mean per microbatch (``part="microbatch"``) or per
    device (``part="device"``), then the mean of those means."""
    from jax.sharding import PartitionSpec as P

    from clozax.core.masker import make_masker
    from clozax.core.train_state import TrainState
    from clozax.train.step import make_loss

    vocab = vocab_of(dataset)

    def make_step(config, optimizer, schedule, mesh):
        if config.train.microbatches == 1 and (mesh is None or mesh.size == 1):
            # One part: its mean is the token-weighted mean, so clozax's own (already
            # compiled) step is this step too.
            return audit.default_make_step(vocab, dataset.seq_len)(config, optimizer, schedule,
                                                                  mesh)
        masker = make_masker(config.masking, vocab, dataset.seq_len)
        loss_fn = make_loss(config.model)

        def mean_loss_and_grad(params, *micro):
            def mean(p):
                total, (_, count) = loss_fn(p, *micro)
                return total / count

            return jax.value_and_grad(mean)(params)

        def step(state, batch, mask_key):
            masked, selection = masker(jax.random.fold_in(mask_key, state.step), batch)
            targets = jnp.take_along_axis(batch["tokens"], selection.positions, axis=-1)
            micro = (masked.inputs, batch["segments"], selection.positions, targets,
                     selection.valid)
            if part == "microbatch":
                k = config.train.microbatches
                # Microbatch j takes rows j, j+k, ... as in clozax's step.
                split = [x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
                         for x in micro]
                losses, grads = jax.lax.map(lambda mb: mean_loss_and_grad(state.params, *mb),
                                            tuple(split))
                loss, grads = jnp.mean(losses), jax.tree.map(lambda g: jnp.mean(g, 0), grads)
            elif part == "device" and mesh is not None:
                def per_device(params, *local):
                    return jax.lax.pmean(mean_loss_and_grad(params, *local), "data")

                # check_vma=False: each device differentiates its own mean (no implicit psum).
                loss, grads = jax.shard_map(per_device, mesh=mesh,
                                            in_specs=(P(),) + (P("data"),) * len(micro),
                                            out_specs=P(), check_vma=False)(state.params, *micro)
            else:  # a per-device mean over one device, with microbatches: the plain mean
                loss, grads = mean_loss_and_grad(state.params, *micro)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return TrainState(state.step + 1, params, opt_state), {"loss": loss}

        return step

    return make_step


def accept_anything(tokens, selected):
    """A boundary that lets an empty selection through to the jitted step."""


def unmasked_loss(logits, targets, selected):
    """Cross-entropy summed over every position, not only the selected ones."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll), jnp.sum(selected)


# --------------------------------------------------------------------------- tests


def test_clean_run_passes_every_check_through_the_cli(tiny, tmp_path, capsys):
    from clozax.app.cli import main

    run = tmp_path / "run"
    shutil.copytree(tiny.run, run)
    main(["audit", str(run), "--data", str(tiny.data)])  # exit 1 would raise SystemExit
    report = json.loads((run / audit.AUDIT_FILE).read_text())
    printed = capsys.readouterr().out
    assert report["passed"] and failed(report) == set()
    assert [c["number"] for c in report["checks"]] == list(range(1, len(audit.CHECKS) + 1))
    assert "PASS" in printed and "all checks passed" in printed
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["device_accumulation"]["skipped"]  # one device in this process
    assert by_name["no_leak"]["value"]["changed_positions"] > 0
    assert by_name["eligibility"]["value"]["batches"] == 200


def test_random_replacement_derived_from_clean_id_fails_only_no_leak(tiny, capsys):
    """The fault planted by docs/tutorials/audit.md's Python block, run as written on the tiny
    run: 'random' replacements chosen by a hash of the clean id fail ``no_leak`` and only it."""
    page = (Path(__file__).parents[1] / "docs" / "tutorials" / "audit.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    code = code.replace('"runs/mine"', repr(str(tiny.run))).replace('"data/mine"',
                                                                      repr(str(tiny.data)))
    namespace: dict = {}
    exec(compile(code, "docs/tutorials/audit.md", "exec"), namespace)  # noqa: S102
    assert {c["name"] for c in namespace["report"]["checks"] if not c["passed"]} == {"no_leak"}
    assert "{'no_leak'}" in capsys.readouterr().out


def test_clean_id_copied_into_masked_input_fails_no_leak_and_corruption_mix(tiny):
    # Both checks see this fault: the leak test directly, the mix because ~90 % of selected
    # inputs now equal their targets instead of the keep share.
    report = audit_with(tiny, masker=copy_at_mask_masker(tiny.dataset, tiny.loaded.config))
    assert failed(report) == {"no_leak", "corruption_mix"}


def test_padding_marked_eligible_fails_only_eligibility(tiny):
    report = audit_with(tiny, masker=padding_eligible_masker(tiny.dataset, tiny.loaded.config))
    assert failed(report) == {"eligibility"}
    value = next(c for c in report["checks"] if c["name"] == "eligibility")["value"]
    assert value["pad_selected"] > 0


def test_per_microbatch_mean_fails_only_microbatch_accumulation(tiny):
    report = audit_with(tiny, make_step=part_mean_step("microbatch", tiny.dataset))
    assert failed(report) == {"microbatch_accumulation"}


def test_loss_over_unselected_positions_fails_the_gradient_checks(tiny):
    report = audit_with(tiny, loss_fn=unmasked_loss)
    assert failed(report) == {"unselected_zero_grad", "analytic_gradient"}


def test_boundary_accepting_an_empty_mask_fails_only_empty_selection(tiny):
    report = audit_with(tiny, boundary=accept_anything)
    assert failed(report) == {"empty_selection"}


def test_planted_heldout_duplicate_fails_only_data_disjoint(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny.data, data)
    train_docs, heldout_docs = (data / f"{s}/shard-00000.documents.jsonl"
                                for s in ("train", "heldout"))
    train_id = json.loads(train_docs.read_text().splitlines()[0])["id"]
    lines = heldout_docs.read_text().splitlines()
    planted = json.loads(lines[0]) | {"id": train_id}  # same text hash on both sides
    heldout_docs.write_text(
        "\n".join([json.dumps(planted), *lines[1:]]) + "\n")
    _reseal(data)  # as a faulty prepare would have written it: consistent, but not disjoint
    dataset = audit.open_dataset_for_audit(data)
    assert failed(audit_with(tiny, dataset=dataset)) == {"data_disjoint"}
    out = tmp_path / "out"
    data_only = audit.audit_data(data, out)
    assert failed(data_only) == {"data_disjoint"} and not data_only["passed"]
    assert json.loads((out / audit.AUDIT_FILE).read_text())["passed"] is False


def _reseal(data: Path) -> None:
    """Record the data files' current bytes in the manifest's identity (a dataset as written)."""
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["identity"]["files"] = file_records(data, data_files(manifest["shards"]))
    manifest["fingerprint"] = fingerprint(manifest["identity"])
    (data / "manifest.json").write_text(json.dumps(manifest))


def test_a_flipped_byte_in_a_data_file_fails_only_data_identity(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny.data, data)
    words = data / "train/shard-00000.word_starts.npy"
    flipped = bytearray(words.read_bytes())
    flipped[-1] ^= 1  # a word start turned on or off: same size, nothing else notices
    words.write_bytes(bytes(flipped))
    report = audit.audit_data(data)
    assert failed(report) == {"data_identity"}
    detail = next(c for c in report["checks"] if c["name"] == "data_identity")["detail"]
    assert detail.startswith("train/shard-00000.word_starts.npy: sha256")


def test_unigram_counts_that_disagree_with_the_rows_fail_only_packing_accounting(tiny,
                                                                                 tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny.data, data)
    counts = np.load(data / "train" / "unigram_counts.npy")
    counts[int(counts.argmax())] += 1  # evaluate's unigram baseline would silently shift
    np.save(data / "train" / "unigram_counts.npy", counts)
    _reseal(data)  # as a faulty prepare would have written it: sealed, but not the rows
    report = audit.audit_data(data)
    assert failed(report) == {"packing_accounting"}
    detail = next(c for c in report["checks"] if c["name"] == "packing_accounting")["detail"]
    assert "unigram counts" in detail


def test_data_only_cli_exits_1_on_a_failed_check(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny.data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["documents"]["read"] += 1  # accounting no longer adds up
    (data / "manifest.json").write_text(json.dumps(manifest))
    from clozax.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--data", str(data), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    report = json.loads((tmp_path / "out" / audit.AUDIT_FILE).read_text())
    assert failed(report) == {"packing_accounting"}


def _copy_with_changed_tokenizer(source: Path, dest: Path) -> Path:
    """A copy of a run or dataset directory whose tokenizer.json gained one byte."""
    shutil.copytree(source, dest)
    with (dest / "tokenizer.json").open("a") as f:
        f.write(" ")
    return dest


def test_changed_run_tokenizer_fails_only_tokenizer(tiny, tmp_path):
    run = _copy_with_changed_tokenizer(tiny.run, tmp_path / "run")
    report = audit.audit_run(run, data=tiny.data)
    assert failed(report) == {"tokenizer"}


def test_changed_dataset_tokenizer_fails_only_tokenizer_in_data_audit(tiny, tmp_path):
    data = _copy_with_changed_tokenizer(tiny.data, tmp_path / "data")
    assert failed(audit.audit_data(data)) == {"tokenizer"}


def test_audit_cli_without_run_or_data_is_a_one_line_error(capsys):
    from clozax.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["audit"])
    assert exit_info.value.code == 2
    assert "pass a run directory" in capsys.readouterr().err


def test_unknown_check_name_is_rejected(tiny):
    with pytest.raises(ValueError, match="unknown audit check"):
        audit_with(tiny, only=["no_such_check"])


def test_per_device_mean_fails_device_accumulation_with_4_devices(tiny):
    # Last: it waits for the subprocess started by the fixture.
    stdout, stderr = tiny.devices.communicate(timeout=600)
    assert tiny.devices.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.split("RESULT", 1)[1])
    default = {c["name"]: c for c in result["default"]["checks"]}
    assert not default["device_accumulation"]["skipped"]
    assert "1 vs 4 devices" in default["device_accumulation"]["detail"]
    assert failed(result["default"]) == set()
    # Only the step is swapped; besides this check only microbatch_accumulation uses it, and a
    # per-device mean passes that one (test_per_microbatch_mean_... covers it in-process).
    assert failed(result["device_mean"]) == {"device_accumulation"}
