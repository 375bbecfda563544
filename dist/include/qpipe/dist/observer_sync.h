// Cross-rank synchronisation of calibration observers, over a process group and the dist ops only.
//
// Contract: every rank calls syncObserver on the same observers in the same order (the modules
// of a decoder layer are the same on every rank). Afterwards every rank's observer holds the
// merge of all ranks' states, which is bit for bit the state one observer would hold after
// seeing all ranks' batches (qpipe/observer.h: states are functions of the multiset of batches),
// so qparams() is the 1-rank answer whatever the world size and the sample deal. A rank whose
// observer saw nothing (an expert no local token reached) takes part with an empty state. With
// one rank every call leaves the observer unchanged.
#pragma once

#include "qpipe/linear_quantizer.h"
#include "qpipe/observer.h"
#include "qpipe/process_group.h"

namespace qpipe::dist {

// aggregation max: the ranks' min/max (elementwise min/max, exact in any order);
// aggregation mean: every rank's per-batch min/max (the mean sorts them before summing).
void syncObserver(ProcessGroup& group, quant::MinMaxObserver& observer);
// Histograms moved onto the largest power-of-two range, counts added, per-bin extremes reduced.
void syncObserver(ProcessGroup& group, quant::HistogramObserver& observer);

// Syncs the quantizer's activation observer and freezes its parameters (LinearQuantizer::freeze):
// what a processor calls between the observing forward and the propagating one. A quantizer that
// observes nothing, or is frozen already, is left as it is (on every rank alike: no collective).
void synchronize(ProcessGroup& group, LinearQuantizer& quantizer);

}  // namespace qpipe::dist
