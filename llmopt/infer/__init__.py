"""llmopt.infer"""
