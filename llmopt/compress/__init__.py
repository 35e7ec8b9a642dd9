"""llmopt.compress"""
