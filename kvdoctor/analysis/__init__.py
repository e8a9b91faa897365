"""The analysis: detectors turn a trace's events into findings; `gate` judges them against budgets."""
