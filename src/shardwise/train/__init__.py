"""Training: the :class:`Trainer` loop and its option sections, ``prepare`` for custom loops, precision, clipping,
metrics, learning-rate helpers, callbacks and loggers."""

from shardwise.train.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    LossMonitor,
    PlotCurves,
    ProgressBar,
    ThroughputMonitor,
)
from shardwise.train.clip import clip_grad_norm_, global_grad_norm
from shardwise.train.loggers import CSVLogger, TensorBoardLogger
from shardwise.train.lr import scale_lr, warmup_cosine
from shardwise.train.metrics import accuracy
from shardwise.train.options import DataOptions, LoggingOptions, ParallelOptions, PrecisionOptions, TrainOptions
from shardwise.train.plot import plot_curves
from shardwise.train.precision import LossScaler
from shardwise.train.prepare import Prepared, prepare
from shardwise.train.trainer import FitResult, Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "DataOptions",
    "EarlyStopping",
    "FitResult",
    "LearningRateMonitor",
    "LoggingOptions",
    "LossMonitor",
    "LossScaler",
    "ParallelOptions",
    "PlotCurves",
    "PrecisionOptions",
    "Prepared",
    "ProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "TrainOptions",
    "Trainer",
    "accuracy",
    "clip_grad_norm_",
    "global_grad_norm",
    "plot_curves",
    "prepare",
    "scale_lr",
    "warmup_cosine",
]
