"""The sections of how a model trains: ``model``, ``train`` and ``loss`` (one subsection per method)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from mmcse.config.checks import check
from mmcse.config.declared import SECTION, Bool, Fraction, Int, NonNegative, Positive, PositiveInt, Str
from mmcse.config.sections import TermSections


@dataclass(frozen=True)
class DuetModelConfig:
    __pydantic_config__ = SECTION
    # train.method duet (DUET §4.2, §5.2; docs/duet.md): the visual stream's own Transformer layers,
    # then the top shared_layers, used by both streams (weight-tied unless tie_shared is false), at
    # joint_dim; the text stream is model.name_or_path (BERT in the paper) fine-tuned.
    visual_layers: Annotated[Int, Field(ge=1)] = 4
    """the visual stream's own Transformer layers (§5.2: 4)"""
    shared_layers: Annotated[Int, Field(ge=0)] = 2
    """k top layers both streams run (§5.2: 2); 0: none"""
    tie_shared: Bool = True
    """false: the text stream gets its own copy (Table 2 "w/o shared layers")"""
    joint_dim: Annotated[Int, Field(ge=1)] = 256
    """the joint space (§5.2: 1024; 256 keeps the CPU demo short)"""
    visual_dim: Annotated[Int, Field(ge=0, description="0: joint_dim")] = 0  # width of the visual-only layers
    heads: Annotated[Int, Field(ge=1)] = 4
    """heads of the added layers (paper silent; profile: 16 of 64 like BERT)"""
    ff_dim: Annotated[Int, Field(ge=1)] = 1024
    """feed-forward width of every added layer (4 × joint_dim, as BERT's)"""
    dropout: Fraction = 0.1
    """in the added layers"""
    box_layer: Int = 0
    """l of Eq. 30 (1..L-1 of the visual stream); 0: min(visual_layers, L - 1)"""
    region_norm: Literal["layernorm", "l2", "none"] = "layernorm"
    """layernorm | l2 | none: on r_i before Eq. 24"""
    spatial: Bool = True
    """b_i enters Eq. 24 (false: Table 2 "w/o spatial features")"""

    def validate(self, where: str) -> None:
        p = "model.duet."
        for name, width in (("joint_dim", self.joint_dim), ("visual_dim", self.visual_dim or self.joint_dim)):
            check(width % self.heads == 0, where, p + name,
                   f"{width} is not divisible by model.duet.heads={self.heads}")
        depth = self.visual_layers + self.shared_layers
        check(self.box_layer == 0 or 1 <= self.box_layer <= depth - 1, where, p + "box_layer",
               f"must be 0 (default) or in [1, {depth - 1}]: an intermediate layer l < L = visual_layers + "
               f"shared_layers = {depth} (Eq. 30)")
        check(depth >= 2, where, p + "visual_layers",
               "visual_layers + shared_layers must be >= 2: Eq. 30 regresses boxes from a layer below the last")


@dataclass(frozen=True)
class VseppModelConfig:
    __pydantic_config__ = SECTION
    # train.method vsepp (Faghri et al. 2018, VSE++; the authors' code fartashf/vsepp defaults):
    # word embeddings → a GRU whose last state is the caption's embedding; a linear map of the image
    # feature; both L2-normalised into a joint_dim space. Words: lowercased, split at whitespace and
    # punctuation, those seen min_word_count times in the training captions (rarer: <unk>).
    word_dim: PositiveInt = 300
    """word embeddings into a GRU; its last state is the caption's embedding"""
    joint_dim: PositiveInt = 1024
    """the joint space (the GRU's width and the image projection's)"""
    gru_layers: PositiveInt = 1
    """layers of the caption GRU"""
    min_word_count: PositiveInt = 4
    """the vocabulary: words seen this often in the training captions (rarer: <unk>)"""
    image_input: Literal["regions", "pixels"] = "regions"
    """the image feature: regions = the mean of the region set's features (the CNN's, cached: its "1C" input) | pixels
    = the CNN regions.grid_model (weights regions.grid_weights) runs in the loop on each image (the authors'
    EncoderImageFull): training crops at random (RandomResizedCrop + flip, data.py get_transform), evaluation takes
    the center crop; the CNN in train mode while training, as theirs"""
    crop_size: Annotated[Int, Field(ge=32)] = 224
    """pixels: train.py --crop_size; evaluation resizes to 8/7 of it (256 for 224) and takes the center crop"""
    # pixels: after train.epochs with the CNN frozen, the best weights train this many more epochs with
    # the CNN's parameters updated too, at finetune_learning_rate (fresh Adam moments): VSE++'s "FT" rows
    finetune_epochs: Annotated[Int, Field(ge=0, description="0: the CNN stays frozen")] = 0
    finetune_learning_rate: Positive = 2e-5
    """the fine-tuning's constant rate"""

    def validate(self, where: str) -> None:
        check(self.finetune_epochs == 0 or self.image_input == "pixels", where, "model.vsepp.finetune_epochs",
              "fine-tunes the CNN, which runs only with model.vsepp.image_input: pixels")


@dataclass(frozen=True)
class VsrnModelConfig:
    __pydantic_config__ = SECTION
    # train.method vsrn (Li et al. 2019, VSRN; the authors' code KunpengLi1994/VSRN, train.py defaults;
    # docs/duet.md): VSE++'s text GRU and vocabulary; regions → fc → gcn_layers region-relation GCNs →
    # a GRU over the regions; a caption generator (GRU encoder, attention GRU decoder) trained beside.
    word_dim: PositiveInt = 300
    """VSE++'s text side: word embeddings into a GRU, its last state the caption's (train.py --word_dim)"""
    joint_dim: PositiveInt = 2048
    """train.py --embed_size (also the GCN and region-GRU width)"""
    gru_layers: PositiveInt = 1
    """the text GRU (train.py --num_layers)"""
    min_word_count: PositiveInt = 4
    """VSE++'s vocabulary threshold (the code reads VSE++'s vocab files)"""
    gcn_layers: PositiveInt = 4
    """region-relation GCNs, R = θ(v)ᵀφ(v) / N; v* = BN(W R g(v)) + v (model.py: Rs_GCN_1..4)"""
    variant: Literal["auto", "coco", "flickr30k"] = "auto"
    """auto: the code's branch for the data (data.pairs flickr30k: flickr30k, else coco) | coco: fc, L2 | flickr30k:
    fc without L2, a BatchNorm on the image embedding (model.py, data_name == 'f30k_precomp')"""
    region_l2: Literal["regions", "features", "none"] = "regions"
    """where the code's l2norm(X) (a sum over dim 1) runs on (B, N, D) regions: regions (the code: each channel across
    the image's regions) | features (each region vector) | none"""
    caption_hidden: PositiveInt = 512
    """the caption generator: GRU encoder over the regions, attention GRU decoder (train.py --dim_hidden)"""
    caption_word_dim: PositiveInt = 300
    """train.py --dim_word"""
    caption_dropout: Fraction = 0.2
    """train.py --input_dropout_p (encoder input, decoder input)"""
    caption_max_len: Annotated[Int, Field(ge=3)] = 60
    """tokens of a caption the generation loss reads, <start> and <end> included (train.py --max_len)"""

    def resolved_variant(self, pairs: str) -> str:
        """The image branch for image–caption pairs ``pairs`` (data.pairs)."""
        if self.variant != "auto":
            return self.variant
        return "flickr30k" if pairs == "flickr30k" else "coco"


@dataclass(frozen=True)
class ModelConfig:
    __pydantic_config__ = SECTION
    # HF id, local folder, or "packaged:all-MiniLM-L6-v2" (weights shipped in a pip package).
    name_or_path: Str = "packaged:all-MiniLM-L6-v2"
    """HF id, local folder, or packaged:<name>"""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: load the weights. random: the same tokenizer and model family with fresh weights, its HF config
    changed by config_overrides (e.g. a 2-layer, 128-wide BERT)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """HF config changes, only with init: random (e.g. {hidden_size: 128})"""
    max_seq_len: Annotated[Int, Field(ge=8, le=512)] = 32
    """tokens per sentence (longer ones are truncated) in training and dev evaluation"""
    proj_dim: PositiveInt = 256
    """width of the shared space of the projection heads"""
    projection_head: Literal["tanh", "linear"] = "tanh"
    """the projection heads g_φ1, g_φ2, g_φt, g_φv: tanh = dense + tanh (KDMCSE §4.1 'MLP Projection Heads', the MCSE
    / KDMCSE code) | linear = one Linear layer (mmcse's earlier heads)"""
    duet: DuetModelConfig = field(default_factory=DuetModelConfig)
    """train.method duet (DUET §4.2; name_or_path is its text stream, BERT in the paper)"""
    vsepp: VseppModelConfig = field(default_factory=VseppModelConfig)
    """train.method vsepp (VSE++, DUET Table 1's baseline; recipes/vsepp.yaml)"""
    vsrn: VsrnModelConfig = field(default_factory=VsrnModelConfig)
    """train.method vsrn (VSRN, DUET Table 1's second baseline; recipes/vsrn.yaml, docs/duet.md)"""

    def validate(self, where: str) -> None:
        check(bool(self.name_or_path.strip()), where, "model.name_or_path", "must not be empty")
        check(
            not self.config_overrides or self.init == "random",
            where,
            "model.config_overrides",
            "changes the architecture, so it needs model.init: random (pretrained weights would not fit)",
        )


def _compile_mode(value: Any) -> Any:
    """``train.compile``: false (YAML 1.1's off too), backbone or step; true (and a number) is refused, naming
    the choices."""
    if value is True or (isinstance(value, int | float) and not isinstance(value, bool)):
        raise ValueError("false, backbone or step (true, which compiled the encoder before there was a choice, is "
                         "now backbone; step compiles the whole training step)")
    return value


@dataclass(frozen=True)
class TrainConfig:
    __pydantic_config__ = SECTION
    # duet / vsepp / vsrn: image–text retrieval models (RETRIEVAL_METHODS), trained on region sets
    method: Literal["simcse", "mcse", "kdmcse", "dalr", "mcseo", "duet", "vsepp", "vsrn"] = "mcse"
    """simcse | mcse | kdmcse | dalr | mcseo | duet | vsepp | vsrn (docs/methods.md, docs/duet.md)"""
    batch_size: Annotated[Int, Field(ge=2, description="in-batch negatives")] = 32
    # 0: no training step: the initial encoder is evaluated (MCSEO Table 1's BERT, RoBERTa rows)
    epochs: Annotated[Int, Field(ge=0, description="0: no training, the encoder is evaluated")] = 1
    max_steps: Annotated[Int, Field(ge=0, description="0: all epochs")] = 20
    learning_rate: Positive = 3e-5
    """AdamW's peak rate (after warm-up; MCSE/KDMCSE: 3e-5 BERT, 1e-5 RoBERTa)"""
    weight_decay: NonNegative = 0.0
    """AdamW's decoupled weight decay"""
    warmup_ratio: Fraction = 0.0
    """share of the steps spent warming the rate up linearly from 0"""
    # 0: the learning rate decays linearly to 0 over training (after warmup_ratio); N: it is divided
    # by 10 every N epochs, no warm-up (VSE++: 15)
    lr_decay_epochs: Annotated[Int, Field(ge=0, description="0: linear decay")] = 0
    # clip the gradient's global L2 norm to this before each update (VSE++: 2)
    max_grad_norm: Annotated[float, Field(ge=0, description="0: no clipping")] = 0.0
    eval_steps: PositiveInt = 10
    """dev STS every N steps (125 on real data); best checkpoint kept"""
    checkpoint_steps: PositiveInt = 10
    """resume point every N steps"""
    dropout: Fraction = 0.1
    """the encoder's dropout: SimCSE's two views of a sentence are its two dropout masks"""
    optimizer: Literal["adamw", "transformers_adamw"] = "adamw"
    """adamw = PyTorch's AdamW (eps 1e-8) | transformers_adamw = transformers 4.x's AdamW, which the MCSE, KDMCSE and
    DALR training loops import (eps 1e-6 added before the bias correction, decay after the update;
    mmcse.training.optimizers)"""
    batch_order: Literal["alternate", "released"] = "alternate"
    """the sentence encoders' text-only and image–caption batches: alternate = every full batch once an epoch, a pair
    batch after every n_text // n_pair text ones | released = the authors' train_mix.py loop: n_text + n_pair steps,
    a pair batch where step % (n_text // n_pair) == 0, both kinds endless streams (mmcse.training.schedule)"""
    dev_truncation: Literal["max_seq_len", "none"] = "max_seq_len"
    """the dev STS sentences that pick the best checkpoint: max_seq_len = cut at model.max_seq_len, as training |
    none = whole (the encoder's own limit), as the authors' evaluate() (uds-lsv/MCSE src/utils.py l.17-21)"""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision of the student's forward pass (fp16 adds a gradient scaler); similarity and logsumexp terms
    stay fp32 whatever this says (τ = 0.05 would amplify bf16 rounding)."""
    compile: Annotated[Literal[False, "backbone", "step"], BeforeValidator(_compile_mode)] = False
    """false | backbone = torch.compile the encoder alone (one graph per padded length) | step = the whole step as
    compiled graphs, CUDA graphs on a GPU (mmcse.training.compiled: tokens padded to model.max_seq_len; worth it on
    a GPU, where an eager step is host-bound; the first steps compile)"""
    dropout_rng: Literal["torch", "per_row"] = "torch"
    """the encoder's dropout masks: torch = torch's dropout (one draw per tensor) | per_row = each row's masks from
    (step, row, layer) alone, whatever batch or process it runs in (mmcse.models.dropout; the sentence encoders and
    DUET; micro_batch and devices > 1 need it)"""
    # gradient-cached batches (Gao et al. 2021, GradCache): sentences per encoder pass; the loss still
    # sees all batch_size in-batch negatives and the update equals the whole batch's (mmcse.training.gradcache)
    micro_batch: Annotated[Int, Field(ge=0, description="0: the whole batch in one pass")] = 0
    # processes (one per GPU) that train one job together, each encoding its share of every batch; the loss
    # still sees all batch_size in-batch negatives and the update is one process's (mmcse.training.distributed;
    # torchrun starts them). auto: every GPU this process sees (1 without one)
    devices: Annotated[PositiveInt | Literal["auto"], Field(description="auto: every visible GPU")] = 1
    nodes: PositiveInt = 1
    """machines, each running `devices` processes; rank 0's machine runs the stage, the others join it at
    master_addr:master_port (docs/pipeline.md, "Several GPUs")"""
    master_addr: Str = "127.0.0.1"
    """nodes > 1: node 0's address, where the others meet it"""
    master_port: Annotated[Int, Field(ge=1, le=65535)] = 29500
    """nodes > 1 or devices > 1: the TCP port the processes meet at on master_addr"""

    @property
    def distributed(self) -> bool:
        """Whether the job may run over several processes (``auto`` may still resolve to one)."""
        return self.devices != 1 or self.nodes > 1

    def validate(self, where: str) -> None:
        check(self.lr_decay_epochs == 0 or self.warmup_ratio == 0, where, "train.warmup_ratio",
              "must be 0 with train.lr_decay_epochs (the step schedule has no warm-up)")
        retrieval = self.method in RETRIEVAL_METHODS
        check(not (retrieval and self.micro_batch), where, "train.micro_batch",
              f"is for the sentence encoders (simcse, mcse, kdmcse, dalr, mcseo); {self.method} trains its image "
              "and caption models end to end on the batch, without gradient caching: set it to 0")
        check(self.method in ("duet", *SENTENCE_ENCODERS) or self.dropout_rng == "torch", where, "train.dropout_rng",
              f"per_row keys the dropout of the sentence encoders and DUET; {self.method}'s models have none to key")
        check(self.micro_batch < self.batch_size, where, "train.micro_batch",
              f"{self.micro_batch} covers the whole batch (train.batch_size {self.batch_size}): gradient caching would "
              "pay its two passes for nothing; set 0 (one pass) or a size below the batch")
        check(self.micro_batch == 0 or self.dropout_rng == "per_row", where, "train.micro_batch",
              "needs train.dropout_rng: per_row (each micro-batch's second pass must draw its first pass's "
              "dropout masks, so the update equals the whole batch's)")
        if self.compile == "step":
            check(self.method in ("duet", *SENTENCE_ENCODERS), where, "train.compile",
                  f"step compiles the sentence encoders' and DUET's steps; {self.method}'s recurrent text encoder "
                  "runs eager: use backbone or false")
            check(self.precision != "fp16", where, "train.compile",
                  "step cannot take fp16's loss scaler (its skipped steps are decided on the host): use "
                  "train.precision: bf16 or fp32")
            check(not self.distributed, where, "train.compile",
                  "step compiles a one-process step; over several devices the step runs eager (train.compile: "
                  "backbone compiles its encoder)")
        if self.distributed:
            check(self.method != "vsrn", where, "train.devices",
                  "vsrn trains on one process: its BatchNorm takes statistics over the whole batch, which a process "
                  "that encodes its share does not see (set train.devices: 1 and train.nodes: 1)")
            check(self.method == "vsepp" or self.dropout_rng == "per_row", where, "train.devices",
                  "needs train.dropout_rng: per_row (a sentence or an image must draw the same dropout masks whichever "
                  "process encodes it, so the processes' update equals one process's)")
            processes = self.devices * self.nodes if isinstance(self.devices, int) else self.nodes
            check(self.batch_size % processes == 0, where, "train.batch_size",
                  f"{self.batch_size} does not split evenly over {processes} processes (train.devices × train.nodes)")


# train.*: how a job is spread over processes, not what it computes (the update is one process's): a resume
# point carries over from one device count to another, and a job's identity leaves them out
LAUNCH_KEYS = ("devices", "nodes", "master_addr", "master_port")

RETRIEVAL_METHODS = ("duet", "vsepp", "vsrn")  # image–text retrieval models: region sets in, R@K out, no STS
SENTENCE_ENCODERS = ("simcse", "mcse", "kdmcse", "dalr", "mcseo")


@dataclass(frozen=True)
class DuetLossConfig:
    __pydantic_config__ = SECTION
    # train.method duet: L_match + λ1·L_bbox + λ2·L_norm (DUET Eq. 33)
    margin: NonNegative = 0.2
    """α of the max-violation hinge (Eq. 28; §5.2: 0.2)"""
    lambda_box: NonNegative = 1.0
    """λ1 (Eq. 30–31 box regression; the paper gives no value); 0: off"""
    lambda_norm: NonNegative = 1.0
    """λ2 (Eq. 32 norm regularizer; no value given); 0: off"""
    reduction: Literal["mean", "sum"] = "mean"
    """over the batch, all three terms (VSE++ sums)"""


@dataclass(frozen=True)
class VseppLossConfig:
    __pydantic_config__ = SECTION
    # train.method vsepp: VSE++'s max-violation hinge (its Eq. 5 = DUET Eq. 28–29), summed over the batch
    margin: NonNegative = 0.2
    """α of VSE++'s max-violation hinge (its Eq. 5)"""


@dataclass(frozen=True)
class VsrnLossConfig:
    __pydantic_config__ = SECTION
    # train.method vsrn: L_M + caption_weight · L_G (VSRN §3.4; the code adds them with weight 1): VSE++'s
    # max-violation hinge summed over the batch, and the caption generator's NLL summed / batch size
    margin: NonNegative = 0.2
    """train.py --margin"""
    caption_weight: NonNegative = 1.0
    """0: matching alone (VSRN without its generation term)"""


@dataclass(frozen=True)
class LossConfig(TermSections):
    """``loss``: the parameters every sentence encoder's terms share, each term module's section (`TermSections`,
    declared beside its terms in src/mmcse/methods/terms/) and the retrieval models' losses."""

    __pydantic_config__ = SECTION
    temperature: Positive = 0.05
    """τ of SimCSE (KDMCSE Eq. 1), the text term of every method"""
    image_term: Bool = True
    """the sentence–image term of mcse (Eq. 3), kdmcse (Eq. 14), mcseo (l_img-cap)"""
    temperature_img: Positive = 0.05
    """τ' of that term and of DALR's L_info"""
    lambda_img: NonNegative = 0.1
    """its weight: λ (MCSE, KDMCSE) / α (MCSEO); papers: 0.01"""
    duet: DuetLossConfig = field(default_factory=DuetLossConfig)
    """train.method duet: L_match + λ1·L_bbox + λ2·L_norm (DUET Eq. 33)"""
    vsepp: VseppLossConfig = field(default_factory=VseppLossConfig)
    """train.method vsepp: VSE++'s max-violation hinge (its Eq. 5 = DUET Eq. 28–29), summed"""
    vsrn: VsrnLossConfig = field(default_factory=VsrnLossConfig)
    """train.method vsrn: L_M (VSE++'s hinge, summed) + caption_weight · L_G (caption NLL / batch)"""
