// The name a loadable plugin's descriptor is exported under, and its forms in a build that links
// plugins statically. Light on purpose (no LibTorch): the one-line entry qpipe_add_plugin
// generates for each loadable library includes only this. Plugins include qpipe/plugin.h.
#pragma once

extern "C" {
struct QpipePluginDescriptor;  // qpipe/plugin.h
}

// A loadable plugin exports the fixed name below. Built with QPIPE_PLUGIN_STATIC_NAME=<name>
// (qpipe_add_plugin compiles a plugin's sources once that way), the descriptor is
// qpipe_plugin_descriptor_<name> instead, not exported: tests link several plugins into one
// binary, and the loadable library adds QPIPE_PLUGIN_FORWARD_ENTRY(<name>).
#define QPIPE_PLUGIN_ENTRY_NAME "qpipe_plugin_descriptor_v1"
#define QPIPE_PLUGIN_CONCAT_IMPL(a, b) a##b
#define QPIPE_PLUGIN_CONCAT(a, b) QPIPE_PLUGIN_CONCAT_IMPL(a, b)
#define QPIPE_PLUGIN_EXPORT __attribute__((visibility("default")))
#ifdef QPIPE_PLUGIN_STATIC_NAME
#define QPIPE_PLUGIN_ENTRY QPIPE_PLUGIN_CONCAT(qpipe_plugin_descriptor_, QPIPE_PLUGIN_STATIC_NAME)
#define QPIPE_PLUGIN_ENTRY_VISIBILITY
#else
#define QPIPE_PLUGIN_ENTRY qpipe_plugin_descriptor_v1
#define QPIPE_PLUGIN_ENTRY_VISIBILITY QPIPE_PLUGIN_EXPORT
#endif

// Declares the statically linked descriptor of plugin `name`.
#define QPIPE_DECLARE_STATIC_PLUGIN(name) \
  extern "C" const QpipePluginDescriptor* QPIPE_PLUGIN_CONCAT(qpipe_plugin_descriptor_, name)()

// The loadable library's entry point when its sources were built with QPIPE_PLUGIN_STATIC_NAME.
#define QPIPE_PLUGIN_FORWARD_ENTRY(name)                                                      \
  QPIPE_DECLARE_STATIC_PLUGIN(name);                                                          \
  extern "C" QPIPE_PLUGIN_EXPORT const QpipePluginDescriptor* qpipe_plugin_descriptor_v1() { \
    return QPIPE_PLUGIN_CONCAT(qpipe_plugin_descriptor_, name)();                             \
  }
