"""Scenario files: TOML validated into frozen, typed config objects.

Unknown keys, wrong types and bad values raise :class:`~fedelastic.errors.ConfigError` naming
the file and the dotted key. A scenario also checks at load time that its strategy, its
strategy options, its model and every device of its fleet exist.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from .config import check, field, from_dict, read_toml, to_dict
from .data.registry import is_plugin
from .data.shifts import Shift
from .data.stream import StreamConfig
from .errors import ConfigError


def _labels(classes: tuple[int, ...]) -> bool:
    return all(c >= 0 for c in classes) and len(set(classes)) == len(classes)


MAX_NAME = 200  # characters of a name or run id (a folder name: most file systems allow 255 bytes)
PLAIN_NAME = (
    f"a plain folder name: printable text of at most {MAX_NAME} characters, "
    "no '/', '\\', ':', leading '.' or '-', or outer spaces"
)


def is_plain_name(value: str) -> bool:
    """One plain folder name of printable text (no terminal escapes, no newline), at most
    ``MAX_NAME`` characters: results built from it stay inside output_dir."""
    if not value or value != value.strip() or value in (".", "..") or value.startswith(("-", ".")):
        return False
    if len(value) > MAX_NAME or not value.isprintable():
        return False
    return not any(c in value for c in "/\\\0:")


MAX_ROUNDS = 1_000_000  # a run's rounds at most (a row each in rounds.csv; a typo's 10**15 is refused)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = field(
        "digits",
        help="'digits' (scikit-learn, 8x8), 'synth_digits' (generated, 32x32 RGB), a registered dataset, "
        "'package.module:callable' or 'file.py:callable', a Hugging Face name, "
        "or a local copy: a save_to_disk folder, .parquet, an imagefolder tree or an .npz (a relative path "
        "is taken from the scenario file's folder)",
    )
    partitioner: Literal["iid", "dirichlet", "shards", "pathological", "natural_id"] = field(
        "dirichlet", help="how client data is split (pathological and natural_id: Hugging Face sources)"
    )
    alpha: float = field(0.5, help="Dirichlet concentration over labels (smaller = more skewed)")
    shards_per_partition: int = field(2, help="shards per client for the 'shards' partitioner")
    classes_per_partition: int = field(2, help="labels per client for the 'pathological' partitioner")
    partition_by: str = field("", help="column of natural ids for 'natural_id' (e.g. 'writer_id')")
    min_partition_size: int = field(2, help="fewest samples a client may hold")
    test_fraction: float = field(
        0.2, help="fraction held out as the server's test set (if the source has no test split)"
    )
    validation: float = field(
        0.0,
        help="share of each client's partition held out, before training, as the server's validation set "
        "(rounds then carry val_accuracy; 0: none). Never taken from the test set",
    )
    size: int = field(0, help="samples of synth_digits to generate (0: 60,000)")
    image_column: str = field("", help="image column (or .npz array) of an external dataset (empty: auto-detect)")
    label_column: str = field("", help="label column (or .npz array) of an external dataset (empty: auto-detect)")
    image_size: int = field(0, help="resize external images to this square size (0: keep)")
    classes: tuple[int, ...] = field((), help="keep only these labels (empty: all)")
    transform: Literal["none", "rotate90", "noise", "invert"] = field("none", help="domain shift of the images")
    shift: Shift = field(default_factory=Shift, help="a parameterised domain shift of the target (see data/shifts.py)")

    def __post_init__(self):
        check(self.dataset.strip() != "", "dataset", "a dataset: 'digits', 'synth_digits', a Hugging Face name or a local path")
        check(self.alpha > 0, "alpha", "a positive number")
        check(0 < self.test_fraction < 1, "test_fraction", "a fraction in (0, 1)")
        check(0 <= self.validation < 1, "validation", "a fraction in [0, 1)")
        check(self.min_partition_size >= 1, "min_partition_size", "an integer >= 1")
        check(self.shards_per_partition >= 1, "shards_per_partition", "an integer >= 1")
        check(_labels(self.classes), "classes", "distinct non-negative labels")
        check(self.classes_per_partition >= 1, "classes_per_partition", "an integer >= 1")
        check(self.size >= 0, "size", "an integer >= 0")
        check(self.image_size >= 0, "image_size", "an integer >= 0")
        builtin = is_plugin(self.dataset)  # built in or registered: an in-memory dataset
        check(
            not (builtin and self.partitioner in ("pathological", "natural_id")),
            "partitioner",
            "iid, dirichlet or shards for a built-in dataset (pathological and natural_id come from flwr-datasets)",
        )
        check(
            self.partitioner != "natural_id" or bool(self.partition_by), "partition_by", "a column name for natural_id"
        )
        check(
            not self.partition_by or self.partitioner == "natural_id",
            "partition_by",
            "empty unless partitioner = 'natural_id'",
        )
        check(self.size == 0 or self.dataset == "synth_digits", "size", "0 unless dataset = 'synth_digits'")
        for key in ("image_column", "label_column", "image_size"):
            check(
                not (builtin and getattr(self, key)), key, "unset for a built-in dataset (it applies to external ones)"
            )


@dataclass(frozen=True)
class PretrainConfig:
    classes: tuple[int, ...] = field((), help="source-task labels (empty: all)")
    transform: Literal["none", "rotate90", "noise", "invert"] = field("none", help="source-domain shift")
    epochs: int = field(30, help="central training epochs")
    lr: float = field(0.05, help="learning rate")
    batch_size: int = field(32, help="batch size")
    seed: int = field(
        -1,
        help="seed of the pretraining and of the train/test split (-1: the run's seed); fixed, one pretrain "
        "(and one test set) is shared by runs of any seed, e.g. a comparison's seeds",
    )

    def __post_init__(self):
        check(-1 <= self.seed < 2**63, "seed", "-1 (the run's seed) or an integer in [0, 2**63)")
        check(self.epochs >= 1, "epochs", "an integer >= 1")
        check(self.lr > 0, "lr", "a positive number")
        check(self.batch_size >= 1, "batch_size", "an integer >= 1")
        check(_labels(self.classes), "classes", "distinct non-negative labels")


@dataclass(frozen=True)
class ModelConfig:
    name: str = field("small_cnn", help="built-in model name, 'package.module:callable' or 'path/to/file.py:callable'")
    options: dict[str, Any] = field(default_factory=dict, help="extra keyword arguments for the factory")
    weights: str = field(
        "",
        help="a weights file to start from (loaded with weights_only=True), or 'torchvision' / 'torchvision:PATH_OR_URL': "
        "torchvision's ImageNet weights for resnet50 / mobilenetv2 built with options.layout = 'torchvision'",
    )
    pretrain: PretrainConfig | None = field(None, help="pretrain centrally on a source task first (cached)")


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = field("full", help="local selection strategy (see `fedelastic strategies`)")
    options: dict[str, Any] = field(default_factory=dict, help="the strategy's options")
    local_epochs: int = field(1, help="passes over the client's data per round")
    max_steps: int = field(0, help="cap on local steps per round (0: no cap)")
    batch_size: int = field(16, help="local batch size")
    lr: float = field(0.05, help="SGD learning rate (measured: benchmarks/studies/training-defaults.md)")
    momentum: float = field(0.9, help="SGD momentum")
    weight_decay: float = field(5e-4, help="SGD weight decay")
    numerics: Literal["device", "fp32"] = field(
        "device",
        help="'device': each client trains in its profile's train_dtype (int8/fp16 emulated); 'fp32': all fp32",
    )
    qas: bool = field(True, help="int8 devices: quantisation-aware scaling of gradients (Lin et al. 2022)")
    quantized_gradients: bool = field(False, help="int8 devices: round weight and input gradients to int8 per channel")
    master_weights: Literal["fp32", "device"] = field(
        "fp32", help="int8/fp16 devices: keep an fp32 copy of trained tensors, or store them in the device dtype"
    )
    optimizer: Literal["sgd", "sgdw"] = field(
        "sgd",
        help="'sgd' (weight decay coupled as L2 in the gradient) or 'sgdw' (decoupled, the ElasticTrainer artifact's)",
    )
    lr_schedule: Literal["constant", "cosine"] = field(
        "constant", help="'constant' or 'cosine' (lr to 0 over each local training; the artifact's is cosine)"
    )
    bn_mode: Literal["auto", "frozen", "train"] = field(
        "train",
        help="'train' (default): a BatchNorm with a trained tensor uses batch statistics, averaged by FedAvg; "
        "'frozen': BatchNorm always in inference mode, gamma/beta trainable (the seed methods', on large "
        "well-converged pretrained models at small lr: it diverged on the shipped small models, see "
        "benchmarks/studies/training-defaults.md); 'auto': 'frozen' when the run starts from pretrained weights "
        "(model.pretrain or model.weights), 'train' from the factory's initialisation",
    )

    def __post_init__(self):
        check(self.local_epochs >= 1, "local_epochs", "an integer >= 1")
        check(self.max_steps >= 0, "max_steps", "an integer >= 0")
        check(self.batch_size >= 1, "batch_size", "an integer >= 1")
        check(self.lr > 0, "lr", "a positive number")
        check(0 <= self.momentum < 1, "momentum", "a number in [0, 1)")
        check(self.weight_decay >= 0, "weight_decay", "a number >= 0")
        check(self.optimizer in ("sgd", "sgdw"), "optimizer", "one of ['sgd', 'sgdw']")
        check(self.lr_schedule in ("constant", "cosine"), "lr_schedule", "one of ['constant', 'cosine']")
        check(self.bn_mode in ("auto", "frozen", "train"), "bn_mode", "one of ['auto', 'frozen', 'train']")




@dataclass(frozen=True)
class ServerConfig:
    rounds: int = field(5, help="federated rounds (aggregations, for policy 'async')")
    clients_per_round: int = field(0, help="clients sampled each round (0: all)")
    policy: str = field(
        "wait_all",
        help="how rounds end: 'wait_all' (the slowest sets the pace), 'deadline_drop' (late updates discarded), "
        "'deadline_fewer_steps' (each client runs the full-training steps that fit; FedNova-normalised), "
        "'deadline_elastic' (each client gets its own rho for the train strategy), 'overcommit' (sample "
        "`overcommit` x clients_per_round, keep the first arrivals), 'async' (FedBuff), or a registered policy",
    )
    deadline: float = field(0.0, help="round deadline in simulated seconds (0: none; or give deadline_quantile)")
    deadline_quantile: float = field(
        0.0, help="deadline as this quantile of the sampled clients' full-training round times (0: none)"
    )
    min_rho: float = field(
        0.0,
        help="policy 'deadline_elastic': a client whose rho would fall below this runs fewer steps at this rho "
        "or more instead (FedNova-normalised); 0: never (rho alone, down to 'too slow')",
    )
    fednova: bool = field(
        True, help="normalise updates by their local steps (FedNova) when a deadline cuts steps (fewer_steps, min_rho)"
    )
    overcommit: float = field(1.3, help="policy 'overcommit': sample this many times clients_per_round")
    concurrency: int = field(0, help="policy 'async': clients training at once (0: clients_per_round, or all)")
    buffer_size: int = field(0, help="policy 'async': arrivals per aggregation (0: half the concurrency, >= 1)")
    staleness: Literal["inverse_sqrt", "none"] = field(
        "inverse_sqrt", help="policy 'async': weight of an update s versions old: 1/sqrt(1+s), or 1"
    )
    aggregator: str = field(
        "fedavg",
        help="server aggregation: 'fedavg' (partial-aware FedAvg), 'fedprox' (clients add a proximal term), "
        "'fedadam' or 'fedyogi' (server optimizers over the averaged update), or a registered one",
    )
    aggregator_options: dict[str, Any] = field(
        default_factory=dict, help="the aggregator's options: fedprox 'mu'; fedadam/fedyogi 'eta', 'beta_1', 'beta_2', 'tau'"
    )
    evaluate_every: int = field(
        1,
        help="evaluate the global model on the test set after rounds that are multiples of this, the initial "
        "model and the last round; other rounds' rows carry NaN accuracy and loss",
    )

    def __post_init__(self):
        check(1 <= self.rounds <= MAX_ROUNDS, "rounds", f"an integer from 1 to {MAX_ROUNDS:,}")
        check(self.clients_per_round >= 0, "clients_per_round", "an integer >= 0")
        check(self.deadline >= 0, "deadline", "a number of seconds >= 0")
        check(0 <= self.deadline_quantile <= 1, "deadline_quantile", "a quantile in (0, 1], or 0 for none")
        has_deadline = self.deadline > 0 or self.deadline_quantile > 0
        check(
            not (self.deadline > 0 and self.deadline_quantile > 0),
            "deadline",
            "either deadline or deadline_quantile, not both",
        )
        from .sim.policies import POLICIES

        check(self.policy in POLICIES, "policy", f"one of {sorted(POLICIES)}")
        if POLICIES[self.policy].deadline == "required":
            check(has_deadline, "deadline", f"a deadline > 0 or a deadline_quantile for policy {self.policy!r}")
        elif POLICIES[self.policy].deadline == "none":
            check(not has_deadline, "deadline", f"no deadline with policy {self.policy!r} (use a deadline_* policy)")
        check(self.overcommit >= 1, "overcommit", "a factor >= 1")
        check(0 <= self.min_rho <= 1, "min_rho", "a number in [0, 1]")
        check(self.min_rho == 0 or self.policy == "deadline_elastic", "min_rho", "0 unless policy = 'deadline_elastic'")
        check(self.concurrency >= 0, "concurrency", "an integer >= 0")
        check(self.buffer_size >= 0, "buffer_size", "an integer >= 0")
        check(self.evaluate_every >= 1, "evaluate_every", "an integer >= 1")


@dataclass(frozen=True)
class AvailabilityConfig:
    model: Literal["profile", "sessions", "diurnal", "trace"] = field(
        "profile",
        help="'profile': a per-round draw with the profile's availability.probability (always online without one); "
        "'sessions': exponential online sessions and offline gaps; 'diurnal': sessions whose gaps follow each "
        "client's time of day; 'trace': online windows from a file",
    )
    mean_session_s: float = field(1800.0, help="mean online session length in seconds (sessions, diurnal)")
    mean_offline_s: float = field(1800.0, help="mean offline gap in seconds (sessions, diurnal)")
    diurnal_amplitude: float = field(0.8, help="diurnal: relative swing of the mean offline gap over a day, in [0, 1)")
    day_s: float = field(86400.0, help="diurnal: length of a day in simulated seconds")
    trace: str = field("", help="trace: CSV or Parquet with columns client_id, start_s, end_s (online windows)")
    period_s: float = field(0.0, help="trace: the windows repeat with this period (0: the largest end_s)")

    def __post_init__(self):
        check(self.mean_session_s > 0, "mean_session_s", "a positive number of seconds")
        check(self.mean_offline_s > 0, "mean_offline_s", "a positive number of seconds")
        check(0 <= self.diurnal_amplitude < 1, "diurnal_amplitude", "a number in [0, 1)")
        check(self.day_s > 0, "day_s", "a positive number of seconds")
        check(self.period_s >= 0, "period_s", "a number of seconds >= 0")
        check(self.model != "trace" or bool(self.trace), "trace", "a trace file for model = 'trace'")


@dataclass(frozen=True)
class BatteryConfig:
    capacity_j: float = field(0.0, help="battery energy per client in joules (0: no battery model)")
    min_fraction: float = field(0.2, help="a client refuses to train below this fraction of its capacity")
    recharge_w: float = field(5.0, help="charging power while plugged in, in watts")
    charge_from_s: float = field(0.0, help="start of the daily charging window, seconds into the day")
    charge_until_s: float = field(28800.0, help="end of the daily charging window, seconds into the day")
    day_s: float = field(86400.0, help="length of a day in simulated seconds")

    def __post_init__(self):
        check(self.capacity_j >= 0, "capacity_j", "a number of joules >= 0")
        check(0 <= self.min_fraction <= 1, "min_fraction", "a fraction in [0, 1]")
        check(self.recharge_w >= 0, "recharge_w", "a number of watts >= 0")
        check(self.day_s > 0, "day_s", "a positive number of seconds")
        check(
            0 <= self.charge_from_s <= self.charge_until_s <= self.day_s,
            "charge_until_s",
            "0 <= charge_from_s <= charge_until_s <= day_s",
        )


@dataclass(frozen=True)
class NetworkConfig:
    model: Literal["nominal", "lognormal", "trace"] = field(
        "nominal",
        help="per-client links: the profile's figures, those times a lognormal factor (median 1), or a trace file",
    )
    sigma: float = field(0.7, help="lognormal: log-standard deviation (0.7: the middle 90% of users span 10x)")
    trace: str = field("", help="trace: CSV or Parquet with columns client_id, uplink_bit_per_s, downlink_bit_per_s")

    def __post_init__(self):
        check(self.sigma >= 0, "sigma", "a number >= 0")
        check(self.model != "trace" or bool(self.trace), "trace", "a trace file for model = 'trace'")


@dataclass(frozen=True)
class SimulationConfig:
    backend: Literal["ray", "inprocess"] = field("ray", help="Flower's Ray backend, or in-process calls (tests)")
    num_cpus_per_client: float = field(1.0, help="Ray CPUs per virtual client")
    ray_address: str = field("", help="address of an existing Ray cluster (empty: start a local one)")
    timeout_s: float = field(3600.0, help="how long the server waits for a round's replies")
    torch_threads: int = field(1, help="torch threads in each client, and in pretraining and the server's evaluation")
    client_retries: int = field(1, help="retries of a client whose process died (Ray), on a fresh worker")
    max_failure_rate: float = field(0.0, help="fraction of client results that may fail before the exit code says so")
    allow_empty_rounds: bool = field(False, help="a round in which no client trained is not an error")
    patches: bool = field(
        True,
        help="fedelastic's patches of private Flower and Ray code (faster start and stop, retries and timeouts "
        "of Ray clients); false runs Flower's and Ray's own code (also: FEDELASTIC_PATCHES=0)",
    )
    node_mode: Literal["cohort", "per_client"] = field(
        "cohort",
        help="'cohort': each Flower node trains a share of a round's virtual clients per call (fast); "
        "'per_client': every virtual client is its own Flower node",
    )
    cohorts: int = field(0, help="cohort mode: Flower nodes sharing each round's clients (0: one per Ray worker, 1 in-process)")
    vectorize: bool | Literal["auto"] = field(
        "auto",
        help="cohort mode: train each call's clients as one batched model (torch.func.vmap); equal to the "
        "per-client path to float32 rounding, not byte for byte. 'auto': wherever the run is eligible and "
        "its model small enough to gain (status.json's training_path says which path ran and why)",
    )
    write_every_s: float = field(
        1.0,
        help="results reach disk at least this often (wall seconds): the rows of faster rounds are "
        "written together, with the newest checkpoint (0: after every round)",
    )
    on_divergence: Literal["stop", "continue"] = field(
        "stop",
        help="a run that diverges (see [divergence]): 'stop' after that round, or 'continue' to the end; "
        "either way it ends with status 'diverged'",
    )

    def __post_init__(self):
        check(0 < self.num_cpus_per_client <= 1024, "num_cpus_per_client", "a number of CPUs in (0, 1024]")
        check(self.timeout_s > 0, "timeout_s", "a positive number of seconds")
        check(0 <= self.write_every_s <= 3600, "write_every_s", "seconds in [0, 3600] (0: after every round)")
        check(1 <= self.torch_threads <= 1024, "torch_threads", "an integer in [1, 1024]")
        check(0 <= self.client_retries <= 10, "client_retries", "an integer in [0, 10]")
        check(0 <= self.max_failure_rate <= 1, "max_failure_rate", "a fraction in [0, 1]")
        check(0 <= self.cohorts <= 100_000, "cohorts", "an integer in [0, 100000] (0: one per Ray worker)")
        check(self.vectorize is not True or self.node_mode == "cohort", "vectorize", 'false or "auto" unless node_mode = "cohort"')
        check(self.cohorts == 0 or self.node_mode == "cohort", "cohorts", '0 unless node_mode = "cohort"')
        check(self.on_divergence in ("stop", "continue"), "on_divergence", "one of ['stop', 'continue']")


@dataclass(frozen=True)
class DivergenceConfig:
    loss_factor: float = field(
        10.0, help="diverged when the mean train loss exceeds this x its first value (at least ln(classes)); 0: off"
    )
    norm_factor: float = field(100.0, help="diverged when the global weights' L2 norm exceeds this x the initial; 0: off")
    collapse_share: float = field(
        0.95,
        help="diverged when this share of test predictions falls in one class (3+ classes) while the test loss "
        "is above (1 + collapse_margin) x the lowest before, in collapse_rounds evaluations in a row; 0: off",
    )
    collapse_margin: float = field(
        0.05, help="a collapse counts only with a test loss above (1 + this) x the lowest before (see collapse_share)"
    )
    collapse_rounds: int = field(2, help="consecutive evaluations a collapse must last (see collapse_share)")
    rejected_share: float = field(
        0.5, help="diverged when more than this share of a round's trained clients send non-finite updates"
    )

    def __post_init__(self):
        check(self.loss_factor == 0 or self.loss_factor > 1, "loss_factor", "a factor > 1, or 0 (off)")
        check(self.norm_factor == 0 or self.norm_factor > 1, "norm_factor", "a factor > 1, or 0 (off)")
        check(
            self.collapse_share == 0 or 0.5 < self.collapse_share <= 1,
            "collapse_share",
            "a share in (0.5, 1], or 0 (off)",
        )
        check(0 <= self.rejected_share < 1, "rejected_share", "a share in [0, 1)")
        check(self.collapse_margin >= 0, "collapse_margin", "a margin >= 0")
        check(self.collapse_rounds >= 1, "collapse_rounds", "a number of evaluations >= 1")


@dataclass(frozen=True)
class Scenario:
    name: str = field(help="scenario name; results go to <output_dir>/<name>/<run-id>")
    fleet: dict[str, int] = field(help="device profile name (or .toml path) -> number of clients")
    seed: int = field(0, help="seed of partitioning, fleet assignment, sampling and training")
    output_dir: str = field("runs", help="where runs are written")
    device_dirs: tuple[str, ...] = field(
        (), help="extra folders of device profiles (a relative path is taken from the scenario file's folder)"
    )
    data: DataConfig = field(default_factory=DataConfig, help="dataset and partitioning")
    model: ModelConfig = field(default_factory=ModelConfig, help="the model")
    train: TrainConfig = field(default_factory=TrainConfig, help="local training")
    server: ServerConfig = field(default_factory=ServerConfig, help="server strategy")
    simulation: SimulationConfig = field(default_factory=SimulationConfig, help="runtime")
    availability: AvailabilityConfig = field(default_factory=AvailabilityConfig, help="when clients are online")
    network: NetworkConfig = field(default_factory=NetworkConfig, help="per-client link rates")
    battery: BatteryConfig = field(default_factory=BatteryConfig, help="per-client battery (optional)")
    divergence: DivergenceConfig = field(
        default_factory=DivergenceConfig, help="when a run counts as diverged (see simulation.on_divergence)"
    )
    stream: StreamConfig | None = field(None, help="a continual stream: tasks, drift, buffers (see data/stream.py)")
    source: str = field("", help="the file this scenario came from (set by the loader)")

    def __post_init__(self):
        check(is_plain_name(self.name), "name", PLAIN_NAME)
        check(0 <= self.seed < 2**63, "seed", "an integer in [0, 2**63)")
        check(bool(self.output_dir.strip()), "output_dir", "a folder path")
        check(len(self.fleet) > 0, "fleet", "at least one device")
        check(all(n <= 1_000_000 for n in self.fleet.values()), "fleet", "at most 1,000,000 clients per device")
        check(
            all(n >= 0 for n in self.fleet.values()) and self.num_clients > 0,
            "fleet",
            "non-negative counts, > 0 in all",
        )
        check(self.server.clients_per_round <= self.num_clients, "server.clients_per_round", "at most the fleet size")
        check(
            self.stream is None or self.stream.federated or self.num_clients == 1,
            "stream.federated",
            "true unless the fleet is one device",
        )
        check(
            self.stream is None or self.server.evaluate_every == 1,
            "server.evaluate_every",
            "1 for a continual stream (its accuracy matrix needs every round)",
        )

    @property
    def split_seed(self) -> int:
        """Seed of the train/test split and of pretraining: ``model.pretrain.seed`` when set, else ``seed``."""
        pre = self.model.pretrain
        return pre.seed if pre is not None and pre.seed >= 0 else self.seed

    @property
    def num_clients(self) -> int:
        return sum(self.fleet.values())

    def to_dict(self) -> dict:
        return to_dict(self)


def _check_aggregator(scenario: Scenario, src: str) -> None:
    """``server.aggregator`` is registered, its options known; combinations that would ignore it are refused."""
    from .sim.aggregators import make_aggregator

    server = scenario.server
    make_aggregator(server, (), src)
    if server.aggregator not in ("fedavg", "fedprox") and server.policy == "async":
        raise ConfigError(src, "server.aggregator", "'fedavg' or 'fedprox' with policy 'async' (FedBuff's own step)", server.aggregator)
    if server.aggregator == "fedprox" and scenario.simulation.vectorize is True:
        raise ConfigError(src, "server.aggregator", "not 'fedprox' with simulation.vectorize (no proximal term there)", server.aggregator)


def validate(scenario: Scenario) -> Scenario:
    """Check the names a scenario refers to: strategy and options, model, devices."""
    from .devices.profile import get_profile
    from .models import model_file, resolve_factory
    from .selection.strategy import make_strategy

    src = scenario.source or "<scenario>"
    _check_aggregator(scenario, src)
    strategy = make_strategy(scenario.train.strategy, scenario.train.options, src=src)
    if scenario.server.policy == "deadline_elastic" and not hasattr(strategy.config, "rho"):
        raise ConfigError(
            src, "train.strategy", "a strategy with a rho budget for policy 'deadline_elastic'", scenario.train.strategy
        )
    if ".py:" in scenario.model.name:  # a model file: absolute, so that Ray workers and a resume find it
        path, _, attr = scenario.model.name.rpartition(":")
        scenario = replace(scenario, model=replace(scenario.model, name=f"{model_file(path, src)}:{attr}"))
    base = Path(scenario.source).parent if scenario.source else Path(".")
    dirs = tuple(str((base / d).resolve()) for d in scenario.device_dirs)  # absolute: Ray workers, resume
    for i, d in enumerate(dirs):
        if not Path(d).is_dir():
            raise ConfigError(src, f"device_dirs[{i}]", "an existing folder of device profiles", d)
    for device in scenario.fleet:
        get_profile(device, dirs, context=src)
    scenario = _resolve_traces(replace(scenario, device_dirs=dirs), base)
    _check_local_copy(scenario.data.dataset, base, src)
    scenario = _resolve_dataset(scenario, src)  # user code: after the other checks
    resolve_factory(scenario.model.name, context=src)  # last: a model file's code runs only once all else passed
    return scenario


_LOCAL = (("./", "../", "/", "~", ".\\", "..\\"), (".npz", ".parquet"))  # how a path to a local copy reads


def _check_local_copy(name: str, base: Path, src: str) -> None:
    """A ``data.dataset`` that reads as a path (``./x.npz``, ``/data/set``, ``x.parquet``) must exist:
    it is not then looked up on the Hugging Face Hub, which would wait for the network and then
    ask for a local copy. A relative path is taken from the scenario file's folder."""
    if is_plugin(name) or not (name.startswith(_LOCAL[0]) or name.endswith(_LOCAL[1])):
        return
    path = base / Path(name).expanduser()
    if not path.exists():
        raise ConfigError(src, "data.dataset", f"an existing file or folder ({path} does not exist)", name)


def _resolve_dataset(scenario: Scenario, src: str) -> Scenario:
    """The dataset factory ``data.dataset`` names, found now (its module or file runs). A path is
    made absolute (Ray's workers and a resume find it). With Ray, a name registered in this
    process becomes its ``module:callable`` or path where it has one (a resume finds it); a
    function of a notebook or a closure keeps its name: the run carries it to the workers
    (:func:`fedelastic.plugins.registered`)."""
    from .data.registry import DATASETS, SHIPPED, resolve_dataset
    from .plugins import plugin_file

    name = scenario.data.dataset
    if not is_plugin(name) or name in SHIPPED:
        return scenario
    entry = DATASETS.get(name, name)
    if isinstance(entry, str) and ".py:" in entry:
        path, _, attr = entry.rpartition(":")
        entry = f"{plugin_file(path, src)}:{attr}"
    factory = resolve_dataset(entry if isinstance(entry, str) else name, context=src)
    if name in DATASETS and scenario.simulation.backend != "ray":
        return scenario  # registered in this process, which runs the clients
    target = entry if isinstance(entry, str) else _import_path(factory)
    if target is None:
        return scenario  # a notebook's function, a closure: carried to the workers by value
    return replace(scenario, data=replace(scenario.data, dataset=target))


def _import_path(factory) -> str | None:
    """``module:function`` by which another process imports ``factory`` (None: a notebook's, a closure, a method)."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or not qualname.isidentifier():
        return None
    return f"{module}:{qualname}"


def _resolve_traces(scenario: Scenario, base: Path) -> Scenario:
    """Trace paths relative to the scenario file, checked now (a bad trace fails before the run)."""
    from .sim.traces import load_availability_trace, load_network_trace

    av, net = scenario.availability, scenario.network
    if av.model == "trace":
        av = replace(av, trace=str((base / av.trace).resolve()))  # absolute: a run's config.toml re-runs
        load_availability_trace(av.trace, scenario.num_clients, av.period_s, src=scenario.source or "<scenario>")
    if net.model == "trace":
        net = replace(net, trace=str((base / net.trace).resolve()))
        load_network_trace(net.trace, scenario.num_clients, src=scenario.source or "<scenario>")
    return replace(scenario, availability=av, network=net)


def parse_scenario(raw: dict, src: str = "<scenario>", *, resolve: bool = True) -> Scenario:
    """A type-checked scenario; ``resolve``: also :func:`validate` the names it refers to (which
    imports a model file's code: without it, no file it names is read and no user code runs)."""
    if "compare" in raw:  # a comparison file: fedelastic.comparisons.comparison reads its [compare] table
        raise ConfigError(
            src, "compare", f"no [compare] table (a comparison: run it with `fedelastic compare {src}` or fe.compare)"
        )
    scenario = from_dict(Scenario, {**raw, "source": src}, src)
    return validate(scenario) if resolve else scenario


def without_recorded(raw: dict, src: str) -> dict:
    """A scenario file's keys, its ``[recorded]`` table left out; a ``source`` key refused.

    ``source`` (the file relative paths resolve against) is set by the loader, never by a file:
    one pointing elsewhere would move where the scenario's files are read from. A run's
    ``config.toml`` records the file it came from as ``[recorded] source``, which a re-run
    ignores (the config.toml is the source then) and ``--resume`` reads (:func:`recorded_source`).
    """
    if "source" in raw:
        raise ConfigError(
            src, "source", "no 'source' key: the loader sets it to the file's own path (a run's config.toml "
            "records it as [recorded] source)", raw["source"],
        )  # fmt: skip
    recorded = raw.get("recorded", {})
    if not isinstance(recorded, dict) or set(recorded) - {"source"} or not isinstance(recorded.get("source", ""), str):
        raise ConfigError(src, "recorded", "a table with the recorded scenario file: recorded.source (a string)", recorded)
    return {k: v for k, v in raw.items() if k != "recorded"}


def recorded(scenario: Scenario) -> dict:
    """``scenario`` as a run's config.toml records it: ``source`` under ``[recorded]``."""
    raw = to_dict(scenario)
    source = raw.pop("source", "")
    return {**raw, "recorded": {"source": source}} if source else raw


def recorded_source(raw: dict) -> str:
    """The scenario file a run's config.toml was recorded from ('' if none); a config.toml written
    before ``[recorded]`` kept it as a top-level ``source``."""
    table = raw.get("recorded", {})
    source = table.get("source", "") if isinstance(table, dict) else ""
    return source or (raw["source"] if isinstance(raw.get("source"), str) else "")


def load_scenario(path: str | Path, *, resolve: bool = True) -> Scenario:
    """Load, type-check and (``resolve``) validate a scenario file."""
    raw = without_recorded(read_toml(path, "scenario"), str(path))
    return parse_scenario(raw, str(path), resolve=resolve)
