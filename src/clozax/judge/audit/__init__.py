"""The audit: the objective's invariants, checked on a run's real batches and data.

Each check is a small function returning a ``CheckResult``; ``run`` takes the pipeline's pieces
(masker, logits function, loss, train-step factory, emptiness boundary), each defaulting to
clozax's own, so a modified corruption function or model can be audited without editing clozax.
``audit_run`` and ``audit_data`` fill the defaults from a run or a dataset directory.

Checks, numbered as printed (``CHECKS``):

 1 no_leak                 changing the clean ids at replaced (mask/random) positions changes
                           neither the encoder inputs nor any logit, bit for bit
 2 corruption_mix          the fraction of selected inputs equal to their target lies in the
                           binomial 99.9 % interval of keep + random / |random pool|
 3 initial_loss            with a zeroed head the loss is log(V) to 1e-5
 4 unselected_zero_grad    unselected output logits get exactly zero gradient
 5 analytic_gradient       autodiff of the loss equals (softmax - onehot) * selected / count
 6 microbatch_accumulation k microbatches give the full batch's loss and gradient (rel 1e-5)
 7 device_accumulation     1 device gives N devices' loss and gradient (skipped when 1 visible)
 8 eligibility             over many batches: no pad or special position selected, the mask id
                           never a target, random replacements never special, unselected
                           inputs untouched, targets the clean ids
 9 data_disjoint           no group and no document hash in both splits
10 tokenizer               trained on train only; sha256 of the files equal the recorded ones
11 packing_accounting      read = kept + duplicates + skipped; rows x seq_len = tokens + pad;
                           the arrays, unigram counts and documents agree with the manifest
12 eval_masks              the stored eval-mask set's sha256 matches, and rebuilding it from the
                           eval key reproduces it
13 empty_selection         an empty selection is rejected on the host with a clear ValueError
14 data_identity           every data file's bytes match the sha256 recorded at prepare time,
                           and the fingerprint hashes the manifest's identity
"""

from clozax.judge.audit.data_checks import open_dataset_for_audit
from clozax.judge.audit.pipeline import CheckResult, Pipeline, default_make_step, default_masker
from clozax.judge.audit.printer import print_report
from clozax.judge.audit.runner import AUDIT_FILE, CHECKS, DATA_CHECKS, audit_data, audit_run, run

__all__ = [
    "AUDIT_FILE", "CHECKS", "DATA_CHECKS", "CheckResult", "Pipeline", "audit_data", "audit_run",
    "default_make_step", "default_masker", "open_dataset_for_audit", "print_report", "run",
]
