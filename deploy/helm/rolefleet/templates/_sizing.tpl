{{/*
The runs volume's size against what the run's checkpoints need (docs/deploy-kubernetes.md,
"Sizing the runs volume"). A full volume fails a checkpoint save hours into a run; here it fails
the install instead.
*/}}

{{/*
A Kubernetes quantity of bytes (100Gi, 2Ti, 500G, 1e12, 107374182400) as a float; (dict "value"
QUANTITY "what" NAME), NAME being the value's key for the error.
*/}}
{{- define "rolefleet.quantityBytes" -}}
{{- $text := toString .value }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(e[+-]?[0-9]+|[KMGTPE]i|[kMGTPE])?$" $text) }}
{{- fail (printf "%s: %q is not a size as Kubernetes writes one (e.g. 500Gi, 2Ti, 500G)" .what $text) }}
{{- end }}
{{- $suffix := regexFind "([KMGTPE]i|[kMGTPE])$" $text }}
{{- $bytes := trimSuffix $suffix $text | float64 }}
{{- $power := index (dict "" 0 "k" 1 "K" 1 "M" 2 "G" 3 "T" 4 "P" 5 "E" 6) (trimSuffix "i" $suffix) }}
{{- $base := ternary 1024.0 1000.0 (hasSuffix "i" $suffix) }}
{{- range until $power }}{{ $bytes = mulf $bytes $base }}{{ end }}
{{- $bytes }}
{{- end }}

{{/* Bytes as whole GiB, rounded up, for messages. */}}
{{- define "rolefleet.gib" -}}
{{- printf "%.0fGi" (ceil (divf . 1073741824.0)) }}
{{- end }}

{{/*
checkpoint.keep of the run config; its default is CheckpointSection's (tests/deploy/test_helm.py
keeps the two in step).
*/}}
{{- define "rolefleet.checkpointKeep" -}}
{{- $cfg := include "rolefleet.config" . | fromYaml }}
{{- dig "checkpoint" "keep" 3 $cfg | int }}
{{- end }}

{{/*
Bytes the run's checkpoints take at their most: checkpoint.keep complete ones and the one being
written (the oldest goes only once the new one is complete), each persistence.checkpointSize;
"" when that is not set (`rolefleet deploy helm-values` sets it where it can read the model).
*/}}
{{- define "rolefleet.checkpointsBytes" -}}
{{- with .Values.persistence.checkpointSize }}
{{- $one := include "rolefleet.quantityBytes" (dict "value" . "what" "persistence.checkpointSize") | float64 }}
{{- mulf $one (add1 (include "rolefleet.checkpointKeep" $ | int)) }}
{{- end }}
{{- end }}

{{/* Fails the render when the claim the chart creates cannot hold the run's checkpoints. */}}
{{- define "rolefleet.checkRunsVolume" -}}
{{- $need := include "rolefleet.checkpointsBytes" . }}
{{- if $need }}
{{- $p := .Values.persistence }}
{{- $size := include "rolefleet.quantityBytes" (dict "value" $p.size "what" "persistence.size") | float64 }}
{{- if lt $size (float64 $need) }}
{{- fail (printf "persistence.size is %v, but the run's checkpoints need %s: checkpoint.keep (%d) complete ones plus the one being written, each persistence.checkpointSize (%v: every trainer role's weights and AdamW state). Raise persistence.size (`rolefleet deploy helm-values` writes one that fits, with room for the logs) or lower checkpoint.keep" $p.size (include "rolefleet.gib" (float64 $need)) (include "rolefleet.checkpointKeep" . | int) $p.checkpointSize) }}
{{- end }}
{{- end }}
{{- end }}
