"""Comparisons over strategies x fleets x seeds, and the HTML report of a run or a comparison."""
