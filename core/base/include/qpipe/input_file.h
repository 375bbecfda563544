// Files a user names (models, data, pipelines, tokenizers) are read only when they are regular
// files: opening a FIFO blocks until a writer comes, and a character device may never end, so
// either would hang a run instead of failing it (docs/cli.md, Validation).
#pragma once

#include <filesystem>
#include <string>

namespace qpipe {

// Error(kIo) "cannot open '<path>': no such file" when it does not exist, Error(kInput) "'<path>'
// is not a regular file (a FIFO)" (or a directory, a character device, …) when it is something
// else. It follows symbolic links.
void requireRegularFile(const std::filesystem::path& path);

// The whole of a regular file (requireRegularFile first).
std::string readInputFile(const std::filesystem::path& path);

// `dir`/`name` of a model folder (config.json, tokenizer.json), which must exist there: otherwise
// Error(kInput) naming the folder and what a model folder holds, where the missing file alone
// would read as an I/O error about a path the user never typed.
std::filesystem::path modelFile(const std::filesystem::path& dir, const std::string& name);

}  // namespace qpipe
