"""Upper bounds of the HetTrainingJob spec's numeric fields and name-like strings.

One table, three users: :mod:`hettrain.api.spec` refuses values above them (field path and
fix in the message), the CRD's structural schema carries the same numbers as ``maximum`` /
``maxLength`` (``crds/`` and the chart's copy; a test compares them with this table), and
the planner may rely on them. Each bound is far above any real job (Llama 3 405B: 126 layers,
hidden 16384, global batch 2048 sequences of 8192 tokens) and low enough that a hostile value
cannot make planning or the runtime's arithmetic explode.
"""

from __future__ import annotations

# dotted field path -> inclusive maximum
SPEC_MAXIMUMS: dict[str, int | float] = {
    "spec.model.layers": 4096,
    "spec.model.hidden": 2**17,
    "spec.model.heads": 4096,
    "spec.model.seqLen": 2**22,
    "spec.model.vocab": 2**24,
    "spec.model.ffnHidden": 2**20,
    "spec.model.kvHeads": 4096,
    "spec.training.globalBatch": 2**24,
    "spec.training.steps": 10**9,
    "spec.training.microBatch": 2**24,
    "spec.training.learningRate": 10.0,
    "spec.training.seed": 2**32 - 1,
    "spec.placement.maxGPUs": 10**7,
    "spec.parallelism.tp": 128,
    "spec.parallelism.pp": 4096,
    "spec.parallelism.dp": 2**24,
    "spec.crossDC.outerSteps": 10**6,
    "spec.crossDC.outerLearningRate": 10.0,
    "spec.crossDC.outerMomentum": 1.0,  # exclusive in the CRD and the parser
    "spec.checkpoint.intervalSteps": 10**9,
    "spec.failurePolicy.maxRepairs": 10**4,
    "spec.failurePolicy.minGPUs": 10**7,
    "spec.failurePolicy.waitSeconds": 7 * 24 * 3600,
    "spec.failurePolicy.debounceSeconds": 3600.0,
    # Llama configuration (spec.model)
    "spec.model.normEps": 1,
    "spec.model.ropeTheta": 1.0e9,
    "spec.model.ropeScaling.factor": 1024,
    "spec.model.ropeScaling.lowFreqFactor": 1024,
    "spec.model.ropeScaling.highFreqFactor": 1024,
    "spec.model.ropeScaling.originalMaxPositionEmbeddings": 2**22,
    # the training loop (spec.training)
    "spec.training.warmupSteps": 10**9,
    "spec.training.minLrRatio": 1,
    "spec.training.wsdDecayFraction": 1,
    "spec.training.gradClip": 1.0e6,
    "spec.training.weightDecay": 10.0,
    "spec.training.adamBetas[]": 1,  # exclusive in the CRD and the parser
    "spec.training.adamEps": 1.0,
    "spec.training.validation.intervalSteps": 10**9,
    "spec.training.validation.batches": 10**4,
    "spec.parallelism.virtualStages": 64,
    "spec.parallelism.cp": 64,
    "spec.checkpoint.keep": 1000,
    # closed-loop calibration (spec.calibration)
    "spec.calibration.replanThreshold": 1,  # exclusive in the CRD and the parser
    "spec.calibration.maxReplans": 100,
    "spec.calibration.minSteps": 10**6,
}

LABEL_VALUE_MAX = 63  # a Kubernetes label value
DNS_SUBDOMAIN_MAX = 253  # object names (PVC, PriorityClass)

# dotted field path (``[]`` for list items, ``{}`` for map values) -> maxLength
SPEC_MAX_LENGTHS: dict[str, int] = {
    "spec.model.name": LABEL_VALUE_MAX,
    "spec.placement.datacenters[]": LABEL_VALUE_MAX,
    "spec.placement.pools[]": LABEL_VALUE_MAX,
    "spec.placement.nodeSelector{}": LABEL_VALUE_MAX,
    "spec.checkpoint.pvc": DNS_SUBDOMAIN_MAX,
    "spec.priorityClassName": DNS_SUBDOMAIN_MAX,
    "spec.schedulerName": DNS_SUBDOMAIN_MAX,
}
