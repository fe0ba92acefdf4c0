"""The Trainer."""

from composerjax.trainer.trainer import Trainer

__all__ = ["Trainer"]
