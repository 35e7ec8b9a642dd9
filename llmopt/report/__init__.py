"""`llmopt report`: gather benchmark write-ups, plots and result JSON into one HTML page."""
