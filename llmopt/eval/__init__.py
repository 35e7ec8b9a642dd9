"""llmopt.eval"""
