"""The `algorithm` section: one model per algorithm (grpo, rloo, reinforce_pp, ppo), picked by `name`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from .sections import _Section

AlgorithmName = Literal["grpo", "rloo", "reinforce_pp", "ppo"]
LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
_KL_MODE = "KL as a loss term, or as a per-token reward penalty (reward: ppo and reinforce_pp only)."
_NAME = (
    "grpo (group baseline), rloo (leave-one-out group baseline), reinforce_pp (REINFORCE++: returns whitened over "
    "the batch, no critic) or ppo (critic + GAE)."
)


class AlgorithmConfig(_Section):
    """Advantages and losses: the keys every algorithm has (`name` picks the algorithm and its own keys)."""

    name: AlgorithmName = Field("grpo", description=_NAME)
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1 + clip_high.")
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip bound c for negative advantages; null = off.  Off by default with policy_loss = "
        "'gspo' (GSPO has no dual clip); when set there it bounds the sequence ratio's loss.",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: one ratio per token; gspo: one ratio per sequence, exp(mean token log-ratio), clipped "
        "per sequence (GSPO pairs it with much tighter clips, ~3e-4/4e-4, and loss_agg seq-mean-token-mean).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference model (0 = no reference); the starting value when "
        "kl_target is set.",
    )
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL: the KL to the reference the coefficient is steered to (proportional "
        "controller); null = fixed kl_coef.",
    )
    kl_horizon: float = Field(
        10000.0,
        gt=0,
        description="Adaptive KL: samples over which the coefficient changes by at most 20%; at least "
        "trainer.samples_per_step.",
    )
    kl_mode: Literal["loss", "reward"] = Field("loss", description=_KL_MODE)
    kl_estimator: Literal["k1", "k2", "k3", "topk"] = Field(
        "k3",
        description="KL estimator: k1, k2 or k3 from the sampled token's logprobs alone; topk: the KL between the "
        "two next-token distributions over the reference's kl_top_k most likely tokens and one bin for the rest "
        "(a lower bound of the exact KL), which also pulls back probability that moved between tokens never "
        "sampled (a learnt format's margins eroding); costs a [tokens x kl_top_k] tensor per micro-batch.",
    )
    kl_top_k: int = Field(
        64, ge=1, le=4096, description="topk KL: the reference's most likely tokens kept per position."
    )
    loss_agg: LossAgg = Field(
        "token-mean",
        description="How token losses are aggregated; seq-mean-token-sum-norm divides each sequence's sum by "
        "rollout.sampling.max_response_length (Dr.GRPO), token-sum does not normalise.",
    )
    off_policy: Literal["none", "tis", "decoupled"] = Field(
        "decoupled",
        description="none: PPO ratio against the behaviour logprobs; tis: truncated-IS policy gradient "
        "(weight min(p_train/p_behaviour, tis_cap), no ratio clip); decoupled: PPO ratio against the proximal "
        "policy (weights before this step) times the truncated behaviour weight.",
    )
    off_policy_level: Literal["token", "sequence"] = Field(
        "token",
        description="Truncated IS weight per token, or one per sequence (the product of its token ratios, "
        "truncated at tis_cap).",
    )
    tis_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weight.")
    staleness_mode: Literal["drop", "keep"] = Field(
        "drop",
        description="Samples older than trainer.max_staleness: drop (counted) or keep with correction.",
    )

    @model_validator(mode="before")
    @classmethod
    def _keys_of_other_algorithms(cls, data: Any) -> Any:
        """A key that belongs to another algorithm says which one, instead of only "extra inputs"."""
        if isinstance(data, dict):
            for key in data:
                owners = [n for n, m in ALGORITHMS.items() if key in m.model_fields]
                if key not in cls.model_fields and owners:
                    raise ValueError(
                        f"{key} is a setting of algorithm.name = {' or '.join(map(repr, owners))} only, "
                        f"not of {data.get('name', 'grpo')!r}"
                    )
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_dual_clip_for_gspo(cls, data: Any) -> Any:
        """GSPO (the paper, and verl's implementation) clips the sequence ratio with no dual clip: a GSPO config
        that does not set dual_clip gets none, rather than the token-level PPO default."""
        if isinstance(data, dict) and data.get("policy_loss") == "gspo" and "dual_clip" not in data:
            return {**data, "dual_clip": None}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.kl_target is not None and self.kl_coef <= 0:
            raise ValueError("kl_target needs kl_coef > 0: the adaptive coefficient starts from kl_coef")
        if self.policy_loss == "gspo" and self.off_policy == "tis":
            raise ValueError(
                "policy_loss = 'gspo' needs a ratio: off_policy 'none' or 'decoupled', not 'tis'"
            )
        return self


class GrpoConfig(AlgorithmConfig):
    """Group baseline: each reward minus its group's mean, optionally over the group's std."""

    name: Literal["grpo"] = Field("grpo", description=_NAME)
    norm_adv_by_std: bool = Field(True, description="grpo: divide by the group std (false = Dr.GRPO).")
    kl_mode: Literal["loss"] = Field("loss", description=_KL_MODE)


class RlooConfig(AlgorithmConfig):
    """Leave-one-out baseline: each reward minus the mean of the other rewards of its group."""

    name: Literal["rloo"] = Field("rloo", description=_NAME)
    kl_mode: Literal["loss"] = Field("loss", description=_KL_MODE)


class ReinforcePPConfig(AlgorithmConfig):
    """REINFORCE++: token returns (reward, less the KL penalty with kl_mode = "reward") whitened over the batch."""

    name: Literal["reinforce_pp"] = Field("reinforce_pp", description=_NAME)


class PpoConfig(AlgorithmConfig):
    """A critic and GAE advantages."""

    name: Literal["ppo"] = Field("ppo", description=_NAME)
    whiten_advantages: bool = Field(False, description="ppo: whiten advantages over the batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: discount.")
    lam: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda.")
    value_clip: float = Field(0.2, ge=0, description="ppo: clipped value loss range.")
    value_coef: float = Field(0.5, ge=0, description="ppo: value loss weight.")


ALGORITHMS: dict[str, type[AlgorithmConfig]] = {
    "grpo": GrpoConfig,
    "rloo": RlooConfig,
    "reinforce_pp": ReinforcePPConfig,
    "ppo": PpoConfig,
}


def _grpo_by_default(data: Any) -> Any:
    return {**data, "name": "grpo"} if isinstance(data, dict) and "name" not in data else data


# The `algorithm` section: one model per algorithm, picked by `name` (grpo when absent).
Algorithm = Annotated[
    GrpoConfig | RlooConfig | ReinforcePPConfig | PpoConfig,
    BeforeValidator(_grpo_by_default),
    Field(discriminator="name"),
]
