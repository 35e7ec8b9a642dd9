"""llmopt.recipe: chain prune / distil / quantize / fuse stages and measure each against the
original (`llmopt compress --recipe`). It stands above `llmopt.compress`, `llmopt.eval` and
`llmopt.infer`, whose functions it drives."""

from llmopt.recipe.config import Recipe, RecipeError
from llmopt.recipe.run import run_recipe

__all__ = ["Recipe", "RecipeError", "run_recipe"]
