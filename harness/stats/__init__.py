"""Statistics: intervals and paired comparisons (`intervals`), every figure's uncertainty
(`uncertainty`), confidence sequences for repeated looks (`sequential`), sample-size planning
(`plan`)."""
