// Pipeline YAML (msmodelslim's modelslim_v1 schema): parsed, validated against the schema of
// every processor it names, and turned into processors.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/processor.h"

namespace qpipe {

class Registry;

// One entry of spec.process; a `group` holds children that share one calibration forward.
struct ProcessStep {
  std::string type;
  ConfigNode config;  // validated, defaults filled in, without `type` (and `configs` for group)
  std::vector<ProcessStep> children;
  std::string path;  // "spec.process[2]" — for messages
  SourceLocation location;
};

struct SaveStep {
  std::string type;   // a registered saver: compressed_tensors, ascendv1_saver, or a plugin's
  ConfigNode config;  // validated against the saver's schema, defaults filled in, without `type`
  SourceLocation location;
};

// metadata.label: what `--quant_type` is matched against.
struct PipelineLabel {
  int wBit = 0;
  int aBit = 0;
  bool isSparse = false;
  bool kvCache = false;
  int faBit = 0;     // 0: attention not quantized
  bool fp8 = false;  // fp8_e4m3 rather than int (qpipe's extension; the _fp8 suffix of --quant_type)
  bool nvfp4 = false;  // NVFP4 rather than int (qpipe's extension; the _nvfp4 suffix of --quant_type)
  bool mxfp4 = false;  // MXFP4 rather than int (qpipe's extension; the _mxfp4 suffix of --quant_type)
  // Activations quantized with calibrated (static) scales rather than per token at run time
  // (qpipe's extension; the _static suffix of --quant_type).
  bool isStatic = false;
};

struct PipelineMetadata {
  std::string configId;
  double score = 100;
  std::optional<PipelineLabel> label;
  std::vector<std::string> verifiedModelTypes;
};

struct Pipeline {
  std::filesystem::path file;
  std::string apiVersion;
  PipelineMetadata metadata;
  std::string runner;  // auto | layer_wise | model_wise | dp_layer_wise (docs/pipeline.md)
  SourceLocation runnerLocation;
  std::vector<ProcessStep> process;
  std::vector<SaveStep> save;  // exactly one: compressed_tensors with its defaults when spec.save is empty
  std::string dataset;         // empty: the CLI's --calib_data or the default set
  ConfigNode resolved;         // the whole document with defaults, for printing
  // Fields that have no effect, "<file:line:col>: <path>: <why>"; buildProcessors puts them among
  // the context's configWarnings, in file order, which the host prints (`qpipe check`, rank 0 of
  // `qpipe quant`).
  std::vector<std::string> warnings;
};

// Reads and validates `file`: the document, every process step against its processor's schema and
// the save step against its saver's (the one place steps are validated). Every error is
// Error(kConfig) with file:line:col, the field path and what was expected; an unknown processor
// or saver type lists the known ones.
Pipeline loadPipeline(const std::filesystem::path& file, const Registry& registry);

// Reads only apiversion and metadata (no plugins needed), e.g. to match --quant_type.
PipelineMetadata readPipelineMetadata(const std::filesystem::path& file);

// Constructs the processors of spec.process in order (a group becomes one processor); the
// pipeline's warnings and the steps' own go into context.configWarnings in the order of the file.
std::vector<std::unique_ptr<Processor>> buildProcessors(const Pipeline& pipeline, const Registry& registry,
                                                        const ProcessorContext& context);

// Error(kConfig) at a step's file:line:col when the pipeline's saver cannot write what the step
// plans (Processor::plannedOutputs, SaverInfo::checkPlanned): `qpipe check` and every run call it
// on the processors of buildProcessors, before any work.
void checkPlannedOutputs(const Pipeline& pipeline, const std::vector<std::unique_ptr<Processor>>& processors,
                         const Registry& registry);

// Error(kUsage) naming the first step (a group's child, not the group) whose processor does not
// support multi-rank runs (Processor::supportDistributed).
void checkMultirank(const Pipeline& pipeline, const std::vector<std::unique_ptr<Processor>>& processors);

}  // namespace qpipe
