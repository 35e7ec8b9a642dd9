"""llmopt.plan"""
