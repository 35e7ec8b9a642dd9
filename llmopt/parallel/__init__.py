"""llmopt.parallel"""
