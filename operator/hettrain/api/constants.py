"""API group, resource names, label keys, condition types and reasons: one place for all of them."""

from __future__ import annotations

GROUP = "hettrain.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "HetTrainingJob"
PLURAL = "hettrainingjobs"
SINGULAR = "hettrainingjob"
SHORT_NAME = "htj"
CLUSTER_KIND = "Cluster"  # offline cluster description (examples/clusters/*.yaml), not a CRD

# Node labels read by the inventory (and written by the kwok node helper).
LABEL_REGION = "topology.kubernetes.io/region"
LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_POOL = f"{GROUP}/pool"
LABEL_DEVICE = f"{GROUP}/device"
LABEL_VENDOR = f"{GROUP}/vendor"
LABEL_NIC_GBPS = f"{GROUP}/nic-gbps"

# Labels put on every child object.
LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
LABEL_APP_COMPONENT = "app.kubernetes.io/component"
LABEL_APP_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = f"{GROUP}/job"
LABEL_RANK = f"{GROUP}/rank"
LABEL_STAGE = f"{GROUP}/stage"
LABEL_GROUP = f"{GROUP}/replica-group"  # only on pods of plans with replica groups
LABEL_PLAN_HASH = f"{GROUP}/plan-hash"
LABEL_ATTEMPT = f"{GROUP}/attempt"

# Extended resource names per vendor.
VENDOR_RESOURCES: dict[str, str] = {
    "nvidia": "nvidia.com/gpu",
    "amd": "amd.com/gpu",
    "intel": "habana.ai/gaudi",
    "huawei": "huawei.com/Ascend910",
}
VENDORS: tuple[str, ...] = tuple(VENDOR_RESOURCES)

# Condition types (status.conditions[].type).
COND_PLANNED = "Planned"
COND_PODS_READY = "PodsReady"
COND_RUNNING = "Running"
COND_REPAIRING = "Repairing"
COND_FAILED = "Failed"
COND_SUCCEEDED = "Succeeded"
COND_SUSPENDED = "Suspended"
COND_CHECKPOINT_STORAGE = "CheckpointStorageReady"
CONDITION_TYPES: tuple[str, ...] = (
    COND_PLANNED,
    COND_PODS_READY,
    COND_RUNNING,
    COND_REPAIRING,
    COND_FAILED,
    COND_SUCCEEDED,
    COND_SUSPENDED,
    COND_CHECKPOINT_STORAGE,
)

# Phases (status.phase, a summary for printer columns).
PHASE_PENDING = "Pending"
PHASE_PLANNING = "Planning"
PHASE_LAUNCHING = "Launching"
PHASE_RUNNING = "Running"
PHASE_REPAIRING = "Repairing"
PHASE_SUSPENDED = "Suspended"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
PHASES: tuple[str, ...] = (
    PHASE_PENDING,
    PHASE_PLANNING,
    PHASE_LAUNCHING,
    PHASE_RUNNING,
    PHASE_REPAIRING,
    PHASE_SUSPENDED,
    PHASE_SUCCEEDED,
    PHASE_FAILED,
)

# Condition reasons (CamelCase).
REASON_INVALID_SPEC = "InvalidSpec"
REASON_PLAN_FAILED = "PlanFailed"
REASON_PLAN_FOUND = "PlanFound"
REASON_INSUFFICIENT_CAPACITY = "InsufficientCapacity"
REASON_PODS_CREATED = "PodsCreated"
REASON_ALL_PODS_READY = "AllPodsReady"
REASON_NODE_LOST = "NodeLost"
REASON_POD_FAILED = "PodFailed"
REASON_MAX_REPAIRS = "MaxRepairsExceeded"
REASON_WAITING_REPLACEMENT = "WaitingForReplacement"
REASON_SUSPENDED = "Suspended"
REASON_COMPLETED = "Completed"
REASON_CHECKPOINT_STORAGE = "CheckpointStorageUnavailable"
REASON_NO_CHECKPOINT = "NoCheckpoint"
REASON_CALIBRATED = "Calibrated"  # measured vs predicted stage times compared
REASON_CALIBRATION_REPLAN = "CalibrationReplan"  # re-planned on the corrected model
REASON_PROFILING = "Profiling"  # profiling pods measure the pools' devices (first plan)

# Env contract between operator-built pods and the runtime.
ENV_PLAN_PATH = "HETTRAIN_PLAN_PATH"
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_NODE_RANK_START = "HETTRAIN_RANK_START"  # first global rank hosted by this pod
ENV_RESUME = "HETTRAIN_RESUME"  # "1" when relaunched after a repair
ENV_CHECKPOINT_URI = "HETTRAIN_CHECKPOINT_URI"
ENV_BACKEND = "HETTRAIN_BACKEND"  # this pod's pool-local collective backend
PLAN_CONFIGMAP_KEY = "plan.json"
DEFAULT_MASTER_PORT = 29500
