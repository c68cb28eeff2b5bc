"""Built-in reference models: a character-level GPT, the guides' SimpleNet MLP and a small ResNet.

Each is ordinary single-device PyTorch; the parallel layers act on them from outside.
"""

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.mlp import SimpleNet
from shardwise.models.resnet import BasicBlock, ResNet, resnet_small

__all__ = ["GPT", "BasicBlock", "GPTConfig", "ResNet", "SimpleNet", "resnet_small"]
