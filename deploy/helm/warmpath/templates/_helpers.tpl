{{/* Names: the release's, cut to the 63 characters Kubernetes allows. */}}
{{- define "warmpath.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "warmpath.router" -}}{{ include "warmpath.fullname" . | trunc 56 | trimSuffix "-" }}-router{{- end -}}
{{- define "warmpath.peers" -}}{{ include "warmpath.fullname" . | trunc 56 | trimSuffix "-" }}-peers{{- end -}}
{{- define "warmpath.agent" -}}{{ include "warmpath.fullname" . | trunc 57 | trimSuffix "-" }}-agent{{- end -}}
{{- define "warmpath.agents" -}}{{ include "warmpath.fullname" . | trunc 56 | trimSuffix "-" }}-agents{{- end -}}

{{/* What routers follow by default: every agent of the DaemonSet, by its headless
     Service (each address its own agent, checked by the name in the chart's certificate). */}}
{{- define "warmpath.defaultAgents" -}}
{{- if include "warmpath.agentEnabled" . -}}
{{- printf "dns:agent@%s.%s.svc.%s:%d" (include "warmpath.agents" .) .Release.Namespace .Values.clusterDomain (int .Values.agent.ports.residency) -}}
{{- end -}}
{{- end -}}

{{- define "warmpath.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "warmpath.routerSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "warmpath.agentSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: cache-agent
{{- end -}}

{{- define "warmpath.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The cache-agent runs when either tier is on. */}}
{{- define "warmpath.agentEnabled" -}}
{{- if or .Values.kvCacheSpec.enableL1Cache .Values.kvCacheSpec.enableL2Cache -}}true{{- end -}}
{{- end -}}

{{/* The default tenant's strategy: the reference's spellings mapped to warmpath's;
     routing off is plain round-robin. */}}
{{- define "warmpath.strategy" -}}
{{- $s := .Values.intelligentRoutingSpec.routingStrategy -}}
{{- if not .Values.intelligentRoutingSpec.enabled -}}round-robin
{{- else if eq $s "prefixaware" -}}prefix-aware
{{- else if eq $s "kvaware" -}}kv-aware
{{- else if eq $s "roundrobin" -}}round-robin
{{- else -}}{{ $s }}
{{- end -}}
{{- end -}}

{{/* Raft voters: never more than the replicas. */}}
{{- define "warmpath.voters" -}}
{{- $v := int .Values.router.raft.voters -}}
{{- if lt (int .Values.router.replicas) $v -}}
{{- fail (printf "router.replicas (%d) is fewer than router.raft.voters (%d): every voter is a replica; raise the replicas or lower the voters" (int .Values.router.replicas) $v) -}}
{{- end -}}
{{- $v -}}
{{- end -}}

{{/* A voter's admin base URL: its stable name under the headless Service. */}}
{{- define "warmpath.peerHost" -}}
{{- $ctx := index . 0 -}}{{- $ordinal := index . 1 -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "warmpath.router" $ctx) $ordinal (include "warmpath.peers" $ctx) $ctx.Release.Namespace $ctx.Values.clusterDomain -}}
{{- end -}}

{{- define "warmpath.routerSecret" -}}{{ .Values.secrets.existingRouterSecret | default (printf "%s-secrets" (include "warmpath.router" .)) }}{{- end -}}
{{- define "warmpath.agentSecret" -}}{{ .Values.secrets.existingAgentSecret | default (printf "%s-secrets" (include "warmpath.agent" .)) }}{{- end -}}
{{- define "warmpath.tlsSecret" -}}{{ .Values.secrets.existingTlsSecret | default (printf "%s-tls" (include "warmpath.fullname" .)) }}{{- end -}}
