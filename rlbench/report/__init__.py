"""`rlbench report`: a run (or two) as one self-contained HTML page.

collect.py   what the page shows, gathered from run directories a step at a time, with the verdicts
             of diff, check logprobs, check tito and check golden and what each compared
page.py      the page: sections, styles and its one small script, inline
svg.py       line charts and histograms as inline SVG, long series thinned to their extremes
"""
