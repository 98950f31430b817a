{{/*
Named templates shared by every manifest. Templates that concern one role take
(dict "root" $ "role" ROLE), ROLE being actor, reward, critic or coordinator.
*/}}

{{- define "rolefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's resource-name prefix. Cut to 40 characters because the longest name built on it,
"<fullname>-reward-headless", must stay a valid Service name (63 characters, DNS-1035).
*/}}
{{- define "rolefleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rolefleet.componentName" -}}
{{- printf "%s-%s" (include "rolefleet.fullname" .root) .role }}
{{- end }}

{{- define "rolefleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "rolefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rolefleet
{{- end }}

{{/* Selector labels stay free of versions: a Deployment's selector cannot change after install. */}}
{{- define "rolefleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rolefleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "rolefleet.componentLabels" -}}
{{ include "rolefleet.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "rolefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rolefleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rolefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/*
The run config text. It is a string, not a map, so that a user's config replaces the default one
whole (Helm deep-merges maps: keys of the default run would leak into a different run) and so that
`--set-file config=run.yaml` passes a config file as it is.
*/}}
{{- define "rolefleet.configText" -}}
{{- if not (kindIs "string" .Values.config) }}
{{- fail "config must be the run config as YAML text (config: |, or --set-file config=run.yaml), not a map" }}
{{- end }}
{{- .Values.config }}
{{- end }}

{{/* The run config parsed, as YAML (callers read it with fromYaml); invalid YAML fails the render. */}}
{{- define "rolefleet.config" -}}
{{- $cfg := include "rolefleet.configText" . | fromYaml }}
{{- if hasKey $cfg "Error" }}
{{- fail (printf "config is not valid YAML: %s" (get $cfg "Error")) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The run's name, as the coordinator names its output directory (run.name, default rolefleet). */}}
{{- define "rolefleet.runName" -}}
{{- $cfg := include "rolefleet.config" . | fromYaml }}
{{- dig "run" "name" "rolefleet" $cfg }}
{{- end }}

{{/* Where the pods that take snapshots mount their memory volume (rolefleet.snapshots). */}}
{{- define "rolefleet.snapshotsDir" -}}
/snapshots
{{- end }}

{{/*
Whether a role's pods get the snapshot volume and checkpoint.snapshot.dir=/snapshots/<run.name>:
"true" or "". Each trainer (actor, critic; every pod of one that spans nodes) writes its part of a
snapshot under that path on its own machine and the coordinator its manifest under the same path
on its own, so all three take it (a trainer refuses a path outside its own snapshot root). Not the
config's default, /dev/shm/rolefleet/...: a pod's /dev/shm is the shm volume, sized for NCCL.
snapshots.enabled may only repeat the run config's checkpoint.snapshot.enabled.
*/}}
{{- define "rolefleet.snapshots" -}}
{{- $cfg := include "rolefleet.config" .root | fromYaml }}
{{- $enabled := dig "checkpoint" "snapshot" "enabled" true $cfg }}
{{- $set := (.root.Values.snapshots | default dict).enabled }}
{{- if and (not (kindIs "invalid" $set)) (ne (toString $set) (toString $enabled)) }}
{{- fail (printf "snapshots.enabled is %v but the run config's checkpoint.snapshot.enabled is %v: make them agree, or leave snapshots.enabled unset (null) to follow the config" $set $enabled) }}
{{- end }}
{{- if and (eq (toString $enabled) "true") (has .role (list "actor" "critic" "coordinator")) }}true{{ end }}
{{- end }}

{{/*
Algorithms that train a value model: the critic runs only for these (`RoleFleetConfig.roles()`;
tests/deploy/test_helm.py keeps this list in step with the algorithm presets).
*/}}
{{- define "rolefleet.criticAlgorithms" -}}
{{- list "ppo" | toJson }}
{{- end }}

{{/*
Algorithms that distil from the teacher role (`RoleFleetConfig.uses_teacher`, with train.distill_coef
> 0 beside any other; tests/deploy/test_helm.py keeps this list in step with the algorithm presets).
*/}}
{{- define "rolefleet.teacherAlgorithms" -}}
{{- list "distill" | toJson }}
{{- end }}

{{/* The role servers this run starts, as a JSON list: the critic only for algorithms that use one,
the teacher only for on-policy distillation. */}}
{{- define "rolefleet.serverRoles" -}}
{{- $cfg := include "rolefleet.config" . | fromYaml }}
{{- $algorithm := dig "algorithm" "ppo" $cfg }}
{{- $roles := list "actor" "reward" }}
{{- if has $algorithm (include "rolefleet.criticAlgorithms" . | fromJsonArray) }}
{{- $roles = append $roles "critic" }}
{{- end }}
{{- $distillCoef := dig "train" "distill_coef" 0 $cfg | float64 }}
{{- if or (has $algorithm (include "rolefleet.teacherAlgorithms" . | fromJsonArray)) (gt $distillCoef 0.0) }}
{{- $roles = append $roles "teacher" }}
{{- end }}
{{- $roles | toJson }}
{{- end }}

{{/*
A role's entries in the run config's devices map, as a JSON list. `devices: cpu` lists none. `devices:
auto` (also what a config without devices means) stands for the map `rolefleet up` chooses on the
machine it runs on: pods need the map itself, so it is refused rather than read as the CPU.
*/}}
{{- define "rolefleet.deviceEntries" -}}
{{- $cfg := include "rolefleet.config" .root | fromYaml }}
{{- $devices := get $cfg "devices" }}
{{- if kindIs "map" $devices }}
{{- toJson (get $devices .role | default list) }}
{{- else if eq (toString $devices) "cpu" }}
{{- toJson list }}
{{- else }}
{{- fail "config: devices is auto (the default without a devices map), which stands for the map `rolefleet up` chooses on its own machine; the chart needs the map itself: set devices to a map (`rolefleet plan CONFIG --gpus N --gpu-gib G` prints the one auto picks), or devices: cpu" }}
{{- end }}
{{- end }}

{{/*
The nodes a role's devices map names ("node:i" entries), in the order they first appear, as a JSON
list; [] when its entries are local GPU indices or it has none.
*/}}
{{- define "rolefleet.deviceNodes" -}}
{{- $nodes := list }}
{{- range $entry := include "rolefleet.deviceEntries" . | fromJsonArray }}
{{- $text := toString $entry }}
{{- if contains ":" $text }}
{{- $node := regexReplaceAll ":[0-9]+$" $text "" }}
{{- if not (has $node $nodes) }}
{{- $nodes = append $nodes $node }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $nodes }}
{{- end }}

{{/*
Pods of a role's worker group: one per node it spans. A trainer (actor, critic) spans the nodes its
devices map names, or on the CPU the run config's <role>.nodes; <role>.nodes of the values may only
repeat that (`rolefleet serve` lays the ranks out from the config). Every other role: 1.
*/}}
{{- define "rolefleet.nodes" -}}
{{- if not (has .role (list "actor" "critic")) }}
{{- 1 }}
{{- else }}
{{- $cfg := include "rolefleet.config" .root | fromYaml }}
{{- $named := include "rolefleet.deviceNodes" . | fromJsonArray | len }}
{{- $count := $named }}
{{- if eq $named 0 }}
{{- $count = dig .role "nodes" 1 $cfg | default 1 | int }}
{{- end }}
{{- $set := (index .root.Values .role).nodes }}
{{- if and (not (kindIs "invalid" $set)) (ne (int $set) (int $count)) }}
{{- fail (printf "%s.nodes is %d but the run config places %s on %d node(s) (devices.%s, or %s.nodes on the CPU): make them agree, or leave %s.nodes unset" .role (int $set) .role (int $count) .role .role .role) }}
{{- end }}
{{- int $count }}
{{- end }}
{{- end }}

{{/* Whether a role's worker group spans nodes: "true" or "". */}}
{{- define "rolefleet.spans" -}}
{{- if gt (include "rolefleet.nodes" . | int) 1 }}true{{ end }}
{{- end }}

{{/*
GPUs a role's pod requests: <role>.gpus, or by default the number of entries in devices.<role> of
the run config (of one node's, for a role that spans nodes: each pod is a node's). `rolefleet serve`
refuses to start when it sees fewer GPUs than its group lists, so a mismatch fails here, at install
time, rather than in a crash-looping pod. One pod template serves every node of a role, so its
nodes must give it as many GPUs each.
*/}}
{{- define "rolefleet.gpus" -}}
{{- if eq .role "coordinator" }}
{{- 0 }}
{{- else }}
{{- $devices := include "rolefleet.deviceEntries" . | fromJsonArray }}
{{- $listed := len $devices }}
{{- $nodes := include "rolefleet.deviceNodes" . | fromJsonArray }}
{{- if gt (len $nodes) 1 }}
{{- $per := dict }}
{{- range $entry := $devices }}
{{- $node := regexReplaceAll ":[0-9]+$" (toString $entry) "" }}
{{- $_ := set $per $node (add1 (get $per $node | default 0)) }}
{{- end }}
{{- $first := get $per (first $nodes) }}
{{- range $node := $nodes }}
{{- if ne (get $per $node) $first }}
{{- fail (printf "devices.%s: node %s lists %d GPUs and node %s %d: the chart runs every node of a role from one pod template, so each must give it as many GPUs" $.role (first $nodes) (int $first) $node (int (get $per $node))) }}
{{- end }}
{{- end }}
{{- $listed = $first }}
{{- end }}
{{- $set := (index .root.Values .role).gpus }}
{{- if kindIs "invalid" $set }}
{{- $listed }}
{{- else if ne (int $set) (int $listed) }}
{{- fail (printf "%s.gpus is %d but devices.%s of the run config lists %d GPUs%s: `rolefleet serve %s` needs to see as many GPUs as its group lists (make them agree, or leave %s.gpus unset)" .role (int $set) .role (int $listed) (ternary " per node" "" (gt (len $nodes) 1)) .role .role) }}
{{- else }}
{{- int $set }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service the pods of a role that spans nodes meet through (and are named by). */}}
{{- define "rolefleet.nodesService" -}}
{{- printf "%s-nodes" (include "rolefleet.componentName" .) }}
{{- end }}

{{/* Where a spanning role's agents meet: its first pod (node 0, rank 0's), by its stable DNS name. */}}
{{- define "rolefleet.rendezvousHost" -}}
{{- printf "%s-0.%s" (include "rolefleet.componentName" .) (include "rolefleet.nodesService" .) }}
{{- end }}

{{/* The gRPC address the coordinator dials for a role: its Service's DNS name. */}}
{{- define "rolefleet.dialAddress" -}}
{{- $port := (index .root.Values .role).port }}
{{- if eq .role "reward" }}
{{- /* The headless Service resolves to every ready replica, not one virtual IP. */}}
{{- printf "%s-headless:%v" (include "rolefleet.componentName" .) $port }}
{{- else }}
{{- printf "%s:%v" (include "rolefleet.componentName" .) $port }}
{{- end }}
{{- end }}

{{/*
The Secret of the run's TLS material (security.tls.secret), or "" for plaintext. Mutual TLS without
certificates cannot work: refused here rather than in every pod.
*/}}
{{- define "rolefleet.tlsSecret" -}}
{{- $tls := dig "tls" dict (.Values.security | default dict) }}
{{- if and (get $tls "mutual") (not (get $tls "secret")) }}
{{- fail "security.tls.mutual needs security.tls.secret: the Secret with ca.pem and each role's <role>.pem and <role>-key.pem" }}
{{- end }}
{{- get $tls "secret" | default "" }}
{{- end }}

{{/* Where a pod sees its TLS files: ca.pem, <role>.pem, <role>-key.pem. */}}
{{- define "rolefleet.tlsDir" -}}
/etc/rolefleet/tls
{{- end }}

{{/*
The host names a role certificate needs, as `rolefleet certs` --host options: every role Service
(the short names are what the coordinator dials, rolefleet.dialAddress) and the namespace's
service domains for clients that dial fully qualified names. `rolefleet certs` adds localhost
and 127.0.0.1 (the probes, a port-forward) on its own.
*/}}
{{- define "rolefleet.certsCommand" -}}
{{- $hosts := list }}
{{- range $role := append (include "rolefleet.serverRoles" . | fromJsonArray) "coordinator" }}
{{- $hosts = append $hosts (include "rolefleet.componentName" (dict "root" $ "role" $role)) }}
{{- if eq $role "reward" }}
{{- $hosts = append $hosts (printf "%s-headless" (include "rolefleet.componentName" (dict "root" $ "role" $role))) }}
{{- end }}
{{- end }}
{{- $hosts = concat $hosts (list (printf "*.%s.svc" .Release.Namespace) (printf "*.%s.svc.cluster.local" .Release.Namespace)) }}
{{- $args := list }}
{{- range $host := $hosts }}
{{- $args = append $args (printf (ternary "--host '%s'" "--host %s" (contains "*" $host)) $host) }}
{{- end }}
{{- printf "rolefleet certs DIR %s" (join " " $args) }}
{{- end }}

{{/*
The Secret holding the run's token under key `token`: security.tokenSecret, else the one the chart
creates (templates/token-secret.yaml); "" only with security.allowUnauthenticated.
*/}}
{{- define "rolefleet.tokenSecret" -}}
{{- $security := .Values.security | default dict }}
{{- with dig "tokenSecret" "" $security }}{{ . }}
{{- else }}{{ if not (dig "allowUnauthenticated" false $security) }}{{ include "rolefleet.fullname" . }}-token{{ end }}
{{- end }}
{{- end }}

{{/* Whether the chart creates the token Secret itself (none named, authentication not turned off). */}}
{{- define "rolefleet.createsTokenSecret" -}}
{{- $security := .Values.security | default dict }}
{{- if not (or (dig "tokenSecret" "" $security) (dig "allowUnauthenticated" false $security)) }}true{{ end }}
{{- end }}

{{/*
The container's arguments: `serve ROLE --config FILE` and the dotted overrides the chart owns (bind
address, ports, output directory, model, role addresses, and with security.* the TLS files and the
token's source), then the role's inputArgs (where the pod reads each model and file: `rolefleet
deploy helm-values` writes them), then its extraArgs, which come last so that they win. inputArgs
and extraArgs are separate values so that a values file setting one keeps the other.
*/}}
{{- define "rolefleet.serveArgs" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $args := list "--log-level" $root.Values.logLevel "serve" $role "--config" "/etc/rolefleet/config.yaml" }}
{{- $args = append $args (printf "%s.host=0.0.0.0" $role) }}
{{- $args = append $args (printf "%s.port=%v" $role $v.port) }}
{{- $args = append $args (printf "%s.metrics_port=%v" $role $v.metricsPort) }}
{{- $args = append $args (printf "run.output_dir=%s/%s" (trimSuffix "/" $root.Values.persistence.mountPath) (include "rolefleet.runName" $root)) }}
{{- if include "rolefleet.snapshots" . }}
{{- $args = append $args (printf "checkpoint.snapshot.dir=%s/%s" (include "rolefleet.snapshotsDir" $root) (include "rolefleet.runName" $root)) }}
{{- end }}
{{- if $root.Values.model.path }}
{{- $args = append $args (printf "model.model_name_or_path=%s" $root.Values.model.path) }}
{{- end }}
{{- if include "rolefleet.spans" . }}
{{- $args = append $args (printf "%s.rendezvous.host=%s" $role (include "rolefleet.rendezvousHost" .)) }}
{{- $args = append $args (printf "%s.rendezvous.port=%v" $role $v.rendezvousPort) }}
{{- end }}
{{- if eq $role "actor" }}
{{- /* The OpenAI-compatible endpoint (bound only where the config enables it: reward.agent). */}}
{{- $args = append $args "actor.endpoint.host=0.0.0.0" }}
{{- $args = append $args (printf "actor.endpoint.port=%v" $v.endpointPort) }}
{{- end }}
{{- if eq $role "coordinator" }}
{{- range $server := include "rolefleet.serverRoles" $root | fromJsonArray }}
{{- $args = append $args (printf "%s.address=%s" $server (include "rolefleet.dialAddress" (dict "root" $root "role" $server))) }}
{{- end }}
{{- $args = append $args (printf "actor.endpoint.url=%s://%s:%v" (ternary "https" "http" (ne (include "rolefleet.tlsSecret" $root) "")) (include "rolefleet.componentName" (dict "root" $root "role" "actor")) $root.Values.actor.endpointPort) }}
{{- $args = append $args (printf "train.connect_timeout_s=%v" $v.connectTimeoutSeconds) }}
{{- $args = append $args (printf "coordinator.http_enabled=%t" $v.http.enabled) }}
{{- if $v.http.enabled }}
{{- $args = append $args "coordinator.http_host=0.0.0.0" }}
{{- $args = append $args (printf "coordinator.http_port=%v" $v.http.port) }}
{{- end }}
{{- end }}
{{- if include "rolefleet.tlsSecret" $root }}
{{- $dir := include "rolefleet.tlsDir" $root }}
{{- /* "{role}" is the role's own name to `rolefleet serve`: each pod mounts its own pair. */}}
{{- $args = append $args (printf "security.tls.cert_file=%s/{role}.pem" $dir) }}
{{- $args = append $args (printf "security.tls.key_file=%s/{role}-key.pem" $dir) }}
{{- $args = append $args (printf "security.tls.ca_file=%s/ca.pem" $dir) }}
{{- $args = append $args (printf "security.tls.mutual=%t" (dig "tls" "mutual" false $root.Values.security)) }}
{{- end }}
{{- if include "rolefleet.tokenSecret" $root }}
{{- /* The token is the Secret's, in ROLEFLEET_TOKEN: not a file the config may name. */}}
{{- $args = append $args "security.token_file=" }}
{{- $args = append $args "security.token_env=ROLEFLEET_TOKEN" }}
{{- else }}
{{- $args = append $args "security.allow_unauthenticated=true" }}
{{- end }}
{{- $args = concat $args (include "rolefleet.inputArgs" . | fromJson).args }}
{{- $args = concat $args ($v.extraArgs | default list) }}
{{- toYaml $args }}
{{- end }}

{{/*
A role's inputArgs as {"args": [...]}, checked: every absolute path they name (KEY=/path, and the
"path" and "tokenizer" of reward.sources' JSON; code keeps its :function) must lie on a volume the
pod mounts, models' (model.mountPath) or inputs' (inputs.mountPath), or the role would stop at its
config check, in a pod's logs. They name every model per role, so a model.path beside them, which
they would override without a word, is refused too.
*/}}
{{- define "rolefleet.inputArgs" -}}
{{- $values := .root.Values }}
{{- $inputArgs := (index $values .role).inputArgs | default list }}
{{- if and $inputArgs $values.model.path }}
{{- fail (printf "model.path is %s, but %s.inputArgs (from `rolefleet deploy helm-values`) already name every model the role reads, which would override it: name the model in the run config instead (or as an override, `rolefleet deploy helm-values CONFIG model.model_name_or_path=models/<name>`), generate the values again, and leave model.path empty as they do" $values.model.path .role) }}
{{- end }}
{{- $mounts := list }}
{{- if or $values.model.existingClaim $values.model.hostPath }}
{{- $mounts = append $mounts (trimSuffix "/" $values.model.mountPath) }}
{{- end }}
{{- if or $values.inputs.existingClaim $values.inputs.hostPath }}
{{- $mounts = append $mounts (trimSuffix "/" $values.inputs.mountPath) }}
{{- end }}
{{- range $arg := $inputArgs }}
{{- range $found := regexFindAll "(^[^=]+=|\"(path|tokenizer)\":\")/[^\":,]*" $arg -1 }}
{{- $path := regexReplaceAll "^[^/]*" $found "" }}
{{- $mounted := false }}
{{- range $mount := $mounts }}
{{- if or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path) }}
{{- $mounted = true }}
{{- end }}
{{- end }}
{{- if not $mounted }}
{{- fail (printf "%s.inputArgs: %s reads %s, which is on no volume the pod mounts: models are on the model volume at model.mountPath (%s; set model.existingClaim or model.hostPath), other files on the inputs volume at inputs.mountPath (%s; set inputs.existingClaim or inputs.hostPath), and the mount paths must be the ones `rolefleet deploy helm-values` mapped to" $.role $arg $path $values.model.mountPath $values.inputs.mountPath) }}
{{- end }}
{{- end }}
{{- end }}
{{- dict "args" $inputArgs | toJson }}
{{- end }}

{{/*
The three health probes; only their timing comes from values. Kubernetes' native gRPC probes speak
no TLS: with security.tls.secret they run the image's probe instead, over TLS with the role's own
certificate (it is a client certificate too, which a mutual-TLS server asks for). Its own deadline
is a second short of the probe's timeout, so that it reports why rather than being killed.
*/}}
{{- define "rolefleet.probes" -}}
{{- $role := .role }}
{{- $port := (index .root.Values $role).port }}
{{- $tls := include "rolefleet.tlsSecret" .root }}
{{- $dir := include "rolefleet.tlsDir" .root }}
{{- $spans := include "rolefleet.spans" . }}
{{- /* A role over several pods serves gRPC from its first (rank 0): every pod of it is as ready as that. */}}
{{- $target := ternary (printf "%s:%v" (include "rolefleet.rendezvousHost" .) $port) (printf "127.0.0.1:%v" $port) (ne $spans "") }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $timing := index $.root.Values.probes $kind }}
{{ $kind }}Probe:
  {{- if or $tls $spans }}
  exec:
    command:
      - python
      - -m
      - rolefleet.deploy.healthcheck
      - {{ $target }}
      - --timeout
      - {{ max 1 (sub (get $timing "timeoutSeconds" | default 1) 1) | quote }}
      {{- if $tls }}
      - --ca
      - {{ $dir }}/ca.pem
      - --cert
      - {{ $dir }}/{{ $role }}.pem
      - --key
      - {{ $dir }}/{{ $role }}-key.pem
      {{- if $spans }}
      # The role's certificate names its Service, not the first pod's own DNS name.
      - --server-name
      - {{ include "rolefleet.componentName" $ }}
      {{- end }}
      {{- end }}
  {{- else }}
  grpc:
    port: {{ $port }}
  {{- end }}
  {{- toYaml $timing | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A role's affinity: its own, else the pod-wide one. A role over several pods (one per node) also gets
one pod per node (anti-affinity on the hostname) and, with <role>.nodeNames (`rolefleet deploy
helm-values` sets them from the devices map), only those nodes; its own affinity replaces both.
*/}}
{{- define "rolefleet.affinity" -}}
{{- $v := index .root.Values .role }}
{{- if or $v.affinity (not (include "rolefleet.spans" .)) }}
{{- toYaml ($v.affinity | default .root.Values.affinity | default dict) }}
{{- else }}
{{- $affinity := deepCopy (.root.Values.affinity | default dict) }}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list (dict
    "topologyKey" "kubernetes.io/hostname"
    "labelSelector" (dict "matchLabels" (include "rolefleet.selectorLabels" . | fromYaml))))) }}
{{- with $v.nodeNames }}
{{- $term := dict "matchExpressions" (list (dict "key" "kubernetes.io/hostname" "operator" "In" "values" .)) }}
{{- $_ = set $affinity "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" (list $term))) }}
{{- end }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}

{{/* Resources from values, plus the role's GPU count under the GPU resource name. */}}
{{- define "rolefleet.resources" -}}
{{- $resources := deepCopy ((index .root.Values .role).resources | default dict) }}
{{- $gpus := include "rolefleet.gpus" . | int }}
{{- if gt $gpus 0 }}
{{- $limits := get $resources "limits" | default dict }}
{{- $_ := set $limits .root.Values.gpuResource $gpus }}
{{- $_ = set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
The pod template of a role: one definition for the Deployments and the coordinator's Job, so the
roles differ only where the values say so.
*/}}
{{- define "rolefleet.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $gpus := include "rolefleet.gpus" . | int }}
{{- /* Every role reads the model: the trainers and a reward model their weights, the coordinator the
actor model's tokenizer (chat template, data.max_prompt_tokens), offline in the image. */}}
{{- $mountsModels := or $root.Values.model.existingClaim $root.Values.model.hostPath }}
{{- /* And every role opens the files of the config (data.path, eval.path; the reward role its code). */}}
{{- $mountsInputs := or $root.Values.inputs.existingClaim $root.Values.inputs.hostPath }}
{{- $tlsSecret := include "rolefleet.tlsSecret" $root }}
{{- $tokenSecret := include "rolefleet.tokenSecret" $root }}
{{- $snapshots := include "rolefleet.snapshots" . -}}
metadata:
  labels:
    {{- include "rolefleet.selectorLabels" . | nindent 4 }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # A changed run config restarts the roles that read it.
    checksum/config: {{ include "rolefleet.configText" $root | sha256sum }}
    {{- if $root.Values.monitoring.scrapeAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $v.metricsPort | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with merge (deepCopy ($v.podAnnotations | default dict)) ($root.Values.podAnnotations | default dict) }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- if eq $role "coordinator" }}
  # The run is over when the coordinator exits; the Job keeps its pod (and exit status) for inspection.
  restartPolicy: Never
  {{- end }}
  serviceAccountName: {{ include "rolefleet.serviceAccountName" $root }}
  # The roles never call the Kubernetes API.
  automountServiceAccountToken: false
  # The roles find each other through the Service names in their arguments, not through env vars.
  enableServiceLinks: false
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with merge (deepCopy ($v.nodeSelector | default dict)) ($root.Values.nodeSelector | default dict) }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "rolefleet.affinity" . | fromYaml }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with concat ($root.Values.tolerations | default list) ($v.tolerations | default list) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $role }}
      image: {{ include "rolefleet.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["rolefleet"]
      args:
        {{- include "rolefleet.serveArgs" . | nindent 8 }}
      ports:
        - name: grpc
          containerPort: {{ $v.port }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.metricsPort }}
          protocol: TCP
        {{- if and (eq $role "coordinator") $v.http.enabled }}
        - name: http
          containerPort: {{ $v.http.port }}
          protocol: TCP
        {{- end }}
        {{- if eq $role "actor" }}
        - name: endpoint
          containerPort: {{ $v.endpointPort }}
          protocol: TCP
        {{- end }}
        {{- if include "rolefleet.spans" . }}
        # The c10d rendezvous: the first pod's agent hosts it, the other pods' agents dial it.
        - name: rendezvous
          containerPort: {{ $v.rendezvousPort }}
          protocol: TCP
        {{- end }}
      env:
        # The root filesystem is read-only: caches (torch.compile, Triton, Hugging Face) go to /tmp.
        - name: HOME
          value: /tmp
        # torch.compile names its cache after the user: set, so that any podSecurityContext.runAsUser works,
        # with or without a passwd entry in the image.
        - name: USER
          value: rolefleet
        - name: PYTHONUNBUFFERED
          value: "1"
        {{- if include "rolefleet.spans" . }}
        # `rolefleet serve` takes its node rank from the ordinal ending the pod's name (pod K: node K).
        - name: ROLEFLEET_POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- end }}
        {{- if eq $gpus 0 }}
        # No GPU was allocated: a CUDA base image would otherwise expose every GPU of the node.
        - name: NVIDIA_VISIBLE_DEVICES
          value: void
        - name: CUDA_VISIBLE_DEVICES
          value: ""
        {{- end }}
        {{- if $tokenSecret }}
        # The run's token (security.token_env): role servers refuse gRPC calls without it, health checks excepted.
        - name: ROLEFLEET_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ $tokenSecret }}
              key: token
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "rolefleet.probes" . | trim | nindent 6 }}
      {{- with include "rolefleet.resources" . | fromYaml }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/rolefleet
          readOnly: true
        - name: runs
          mountPath: {{ $root.Values.persistence.mountPath }}
        - name: tmp
          mountPath: /tmp
        - name: shm
          mountPath: /dev/shm
        {{- if $snapshots }}
        - name: snapshots
          mountPath: {{ include "rolefleet.snapshotsDir" $root }}
        {{- end }}
        {{- if $mountsModels }}
        - name: models
          mountPath: {{ $root.Values.model.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $mountsInputs }}
        - name: inputs
          mountPath: {{ $root.Values.inputs.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $tlsSecret }}
        - name: tls
          mountPath: {{ include "rolefleet.tlsDir" $root }}
          readOnly: true
        {{- end }}
        {{- with $root.Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "rolefleet.fullname" $root }}-config
    - name: runs
      {{- if $root.Values.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ $root.Values.persistence.existingClaim | default (printf "%s-runs" (include "rolefleet.fullname" $root)) }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $root.Values.tmp.sizeLimit }}
    # A role's worker processes (torch.distributed, NCCL) exchange tensors through shared memory;
    # the container runtime's default /dev/shm is 64 MiB.
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.shm.sizeLimit }}
    {{- if $snapshots }}
    # Per-step snapshots (checkpoint.snapshot.dir): memory, as the config's default /dev/shm path is,
    # kept across a restart of the container (a lost trainer resumes from the last step) but not of
    # the pod. What it holds counts against the pod's memory.
    - name: snapshots
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.snapshots.sizeLimit }}
    {{- end }}
    {{- if $mountsModels }}
    - name: models
      {{- if $root.Values.model.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $root.Values.model.existingClaim }}
        readOnly: true
      {{- else }}
      hostPath:
        path: {{ $root.Values.model.hostPath }}
        type: Directory
      {{- end }}
    {{- end }}
    {{- if $mountsInputs }}
    - name: inputs
      {{- if $root.Values.inputs.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $root.Values.inputs.existingClaim }}
        readOnly: true
      {{- else }}
      hostPath:
        path: {{ $root.Values.inputs.hostPath }}
        type: Directory
      {{- end }}
    {{- end }}
    {{- if $tlsSecret }}
    # The CA certificate and this role's own certificate and key, nothing else of the Secret (not
    # the other roles' keys, nor a CA key that was left in it). Owner and group read: the group is
    # the pod's fsGroup, so the non-root user reads them; a renewed Secret reaches the files, and
    # the servers pick it up at their next handshake.
    - name: tls
      secret:
        secretName: {{ $tlsSecret }}
        defaultMode: 0440
        items:
          - key: ca.pem
            path: ca.pem
          - key: {{ $role }}.pem
            path: {{ $role }}.pem
          - key: {{ $role }}-key.pem
            path: {{ $role }}-key.pem
    {{- end }}
    {{- with $root.Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
