"""llmopt.precision"""
